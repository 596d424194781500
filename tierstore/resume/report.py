"""The report of a resume verification: what differs between a live run and its checkpoint.

Pure data and comparison, no torch: each rank's live record (loss, digest of every state key)
and its fresh process's result (the same after loading, plus the keys the checkpoint lacks)
become one :class:`ResumeReport` naming each mismatch by part of the training state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ResumeReport", "Mismatch", "part_of", "compare", "rank_outcome", "assemble"]


_PARTS = {
    "model": "model",
    "optim": "optimizer",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "lr_scheduler": "scheduler",
    "rng": "rng",
    "step": "step",
    "data": "data",
    "sampler": "data",
    "dataloader": "data",
    "extra": "extra",
}


def part_of(key: str) -> str:
    """Which part of the training state a flattened key belongs to (``train.optim.x`` -> optimizer)."""
    for component in key.split("."):
        if component in _PARTS:
            return _PARTS[component]
    return "other"


@dataclass(frozen=True)
class Mismatch:
    """One key of the state that did not survive the round trip, and on which ranks."""

    key: str
    part: str
    problem: str  # e.g. "missing from the checkpoint", "differ from the live state"
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ResumeReport:
    """The outcome of one resume verification; ``ok`` only if nothing at all differs."""

    checkpoint: str
    world_size: int
    loss_before: tuple[float | None, ...]  # per rank; None when there is no live record
    loss_after: tuple[float | None, ...]
    mismatches: tuple[Mismatch, ...] = ()
    errors: tuple[str, ...] = ()
    rtol: float = 0.0
    atol: float = 0.0
    compared_live: bool = True
    keys_checked: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def loss_ok(self) -> bool:
        if not self.compared_live:
            return all(a is not None for a in self.loss_after)
        return all(_close(b, a, self.rtol, self.atol) for b, a in zip(self.loss_before, self.loss_after))

    @property
    def ok(self) -> bool:
        return not self.errors and not self.mismatches and self.loss_ok

    def parts_failed(self) -> list[str]:
        return sorted({m.part for m in self.mismatches})

    def __repr__(self) -> str:
        # Counts, not the mismatches themselves: a report can name thousands of keys.
        parts = f" ({', '.join(self.parts_failed())})" if self.mismatches else ""
        return (
            f"ResumeReport(checkpoint={self.checkpoint!r}, ok={self.ok}, "
            f"world_size={self.world_size}, keys_checked={self.keys_checked}, "
            f"mismatches={len(self.mismatches)}{parts}, errors={len(self.errors)}, "
            f"loss_before={self.loss_before!r}, loss_after={self.loss_after!r})"
        )

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(ok=self.ok, loss_ok=self.loss_ok, parts_failed=self.parts_failed())
        return body

    def summary(self, limit: int = 4) -> str:
        verdict = "OK" if self.ok else "FAILED"
        lines = [f"verify_resume {self.checkpoint} on {self.world_size} rank(s): {verdict}"]
        lines.append("  " + self._loss_line())
        groups: dict[tuple[str, str], list[Mismatch]] = {}
        for m in self.mismatches:
            groups.setdefault((m.part, m.problem), []).append(m)
        for (part, problem), found in sorted(groups.items()):
            keys = ", ".join(m.key for m in found[:limit])
            more = f", ... ({len(found) - limit} more)" if len(found) > limit else ""
            ranks = sorted({r for m in found for r in m.ranks})
            lines.append(f"  {part}: {len(found)} key(s) {problem} (rank {_ranks(ranks)}): {keys}{more}")
        if not self.mismatches and not self.errors:
            lines.append(
                f"  state: all {self.keys_checked} keys identical (model, optimizer, "
                "scheduler, step, RNG, data position as saved)"
            )
        lines.extend(f"  error: {e}" for e in self.errors)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _loss_line(self) -> str:
        after = _fmt_losses(self.loss_after)
        if not self.compared_live:
            return f"loss on the fixed batch after loading: {after} (no live record to compare with)"
        exact = self.rtol == 0 and self.atol == 0
        same = "identical" if exact else f"within rtol {self.rtol} atol {self.atol}"
        verdict = same if self.loss_ok else "DIFFERENT"
        return (
            f"loss on the fixed batch: before save {_fmt_losses(self.loss_before)}, "
            f"fresh process {after}: {verdict}"
        )


def _fmt_losses(losses: Sequence[float | None]) -> str:
    values = ["-" if x is None else repr(x) for x in losses]
    return values[0] if len(set(values)) == 1 else "[" + ", ".join(values) + "]"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def _close(before: float | None, after: float | None, rtol: float, atol: float) -> bool:
    if before is None or after is None:
        return False
    if rtol == 0 and atol == 0:
        return before == after or (math.isnan(before) and math.isnan(after))
    return math.isclose(before, after, rel_tol=rtol, abs_tol=atol)


def compare_rank(live: Mapping[str, Any] | None, fresh: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, problem)`` for one rank: live digests vs the fresh process's digests."""
    if fresh.get("error"):
        return []  # it failed before digesting anything: the error is the finding
    missing = set(fresh.get("missing", ()))
    problems = [(k, "missing from the checkpoint") for k in sorted(missing)]
    if live is None:
        return problems
    before, after = live["digests"], fresh.get("digests", {})
    for key in sorted(set(before) | set(after)):
        if key in missing:
            continue
        if key not in after:
            problems.append((key, "only in the live state (not in what the probe builds)"))
        elif key not in before:
            problems.append((key, "only in what the probe builds (not in the live state)"))
        elif before[key] != after[key]:
            problems.append((key, "differ from the live state"))
    return problems


def rank_outcome(live: Mapping[str, Any] | None, fresh: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's part of the report: small, so gathering it from every rank stays cheap."""
    return {
        "loss_before": None if live is None else live.get("loss"),
        "loss_after": fresh.get("loss"),
        "error": fresh.get("error"),
        "problems": compare_rank(live, fresh),
        "keys": len(fresh.get("digests", {})),
        "live": live is not None,
    }


def assemble(
    checkpoint: str,
    outcomes: Sequence[Mapping[str, Any]],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    seconds: float = 0.0,
) -> ResumeReport:
    """The report from every rank's :func:`rank_outcome`, in rank order."""
    merged: dict[tuple[str, str], list[int]] = {}
    errors = []
    for rank, outcome in enumerate(outcomes):
        if outcome["error"]:
            errors.append(f"rank {rank} fresh process: {outcome['error']}")
        for key, problem in outcome["problems"]:
            merged.setdefault((key, problem), []).append(rank)
    mismatches = tuple(
        Mismatch(key, part_of(key), problem, tuple(ranks)) for (key, problem), ranks in sorted(merged.items())
    )
    compared_live = all(o["live"] for o in outcomes)
    return ResumeReport(
        checkpoint=checkpoint,
        world_size=len(outcomes),
        loss_before=tuple(o["loss_before"] for o in outcomes),
        loss_after=tuple(o["loss_after"] for o in outcomes),
        mismatches=mismatches,
        errors=tuple(errors),
        rtol=rtol,
        atol=atol,
        compared_live=compared_live,
        keys_checked=max((o["keys"] for o in outcomes), default=0),
        seconds=seconds,
        notes=() if compared_live else ("without a live record only completeness and the load were checked",),
    )


def compare(
    checkpoint: str,
    live: Sequence[Mapping[str, Any] | None],
    fresh: Sequence[Mapping[str, Any]],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    seconds: float = 0.0,
) -> ResumeReport:
    """The report from every rank's live record (or ``None``) and fresh-process result."""
    outcomes = [rank_outcome(mine, theirs) for mine, theirs in zip(live, fresh)]
    return assemble(checkpoint, outcomes, rtol=rtol, atol=atol, seconds=seconds)
