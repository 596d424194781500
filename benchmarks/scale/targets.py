"""Issue 15's four targets, judged from one backend's replays at every W.

"Independent of W" is judged past ``PART_RANKS`` (1,024 ranks per manifest part): a
checkpoint of fewer ranks keeps its flat manifest, whose size grows with W by design; past
it, a value may be at most ``FLAT`` times the most seen up to ``PART_RANKS``, plus a small
slack (a root manifest grows by one line per part).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.scale.results import Measurement

__all__ = ["Target", "judge"]

FLAT = 1.5
SLACK_REQUESTS = 2
SLACK_BYTES = 8 << 10


@dataclass(frozen=True)
class Target:
    name: str
    formula: str
    value: str
    met: bool | None  # None: not measurable in these runs


def _load_bytes(ms: Sequence[Measurement]) -> Target:
    worst = max(ms, key=lambda m: m.load_ratio_max)
    return Target(
        "per-rank bytes read on load",
        "data bytes read <= 1.1 x plan bytes",
        f"{worst.load_ratio_max:.2f}x (W={worst.world})",
        worst.load_ratio_max <= 1.1 if worst.load_ratio_max else None,
    )


def _coord(ms: Sequence[Measurement]) -> Target:
    def bound(w: int) -> float:
        return w / 1000 + w / 64 + 10

    worst = max(ms, key=lambda m: m.phases["cold"].coord_cold_requests - bound(m.world))
    sent = worst.phases["cold"].coord_cold_requests
    return Target(
        "cold commit: coordinator requests",
        "<= W/1000 + W/64 + 10",
        f"{sent} vs {bound(worst.world):.1f} (W={worst.world})",
        all(m.phases["cold"].coord_cold_requests <= bound(m.world) for m in ms),
    )


def _upload(ms: Sequence[Measurement]) -> Target:
    worst = max(ms, key=lambda m: m.upload_excess_max)
    files = worst.files_per_rank
    return Target(
        "cold commit: per-rank upload requests",
        "<= 1 + 2F",
        f"{worst.upload_requests_max} vs {1 + 2 * files} (F={files}, W={worst.world})",
        all(m.upload_excess_max <= 0 for m in ms),
    )


def _independent(ms: Sequence[Measurement]) -> Target:
    # Up to PART_RANKS ranks a checkpoint keeps its flat manifest (by design, so old readers
    # read it): its size grows with W up to there. Past it only the root is read.
    small = [m for m in ms if m.world <= m.part_ranks]
    large = [m for m in ms if m.world > m.part_ranks]
    parts, ok = [], True
    for phase in ("list", "status", "prune"):
        req = {m.world: _judged_requests(m, phase) for m in ms}
        read = {m.world: m.phases[phase].coord_read for m in ms}
        most_req = max(req[m.world] for m in small or ms)
        most_read = max(read[m.world] for m in small or ms)
        ok &= all(
            req[m.world] <= FLAT * most_req + SLACK_REQUESTS
            and read[m.world] <= FLAT * most_read + SLACK_BYTES
            for m in large
        )
        parts.append(f"{phase} " + ", ".join(f"{req[w]} req/{read[w]} B" for w in req))
    return Target(
        "list / status / prune independent of W",
        f"every W > PART_RANKS <= {FLAT} x the most at W <= PART_RANKS (+{SLACK_REQUESTS}"
        f" req, +{SLACK_BYTES >> 10} KiB); prune without finding and deleting the doomed keys"
        " (listings and batch deletes, one request per 1,000 keys each)",
        "; ".join(parts),
        ok if small and large else None,
    )


def _judged_requests(m: Measurement, phase: str) -> int:
    """A phase's coordinator requests the target judges. Prune must find and delete every
    key of a doomed attempt, one listing page and one batch per 1,000 keys: that work grows
    with the keys deleted, as it must; what is judged is the rest (manifests, checks)."""
    stats = m.phases[phase]
    if phase != "prune":
        return stats.coord_requests_no_delete
    listings = sum(n for kind, n in stats.coord_by_kind.items() if kind.endswith(".list"))
    return stats.coord_requests_no_delete - listings


def _manifest(ms: Sequence[Measurement]) -> Target:
    norm = {m.world: m.load_manifest_max / min(m.world, m.part_ranks) for m in ms}
    above = [m.world for m in ms if m.world > m.part_ranks]
    value = ", ".join(f"W={w}: {v:.0f} B/rank" for w, v in norm.items())
    met = None if not above else all(norm[w] <= FLAT * min(norm.values()) for w in above)
    return Target(
        "manifest bytes one rank reads on load",
        f"(manifest bytes read) / min(W, PART_RANKS) flat in W (<= {FLAT} x its least)",
        value,
        met,
    )


def judge(ms: Sequence[Measurement]) -> list[Target]:
    """The targets over one backend's measurements (any order)."""
    ms = sorted(ms, key=lambda m: m.world)
    if not ms:
        return []
    return [_load_bytes(ms), _coord(ms), _upload(ms), _independent(ms), _manifest(ms)]
