"""A replay's counts, boiled down per phase to what the report shows (JSON-able)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import mean
from typing import Any

from benchmarks.scale.counting import COORDINATOR, Tally
from benchmarks.scale.sim import PHASES, SimRun, tree_part_ranks

__all__ = ["PhaseStats", "Measurement", "measure", "DELETES"]

DELETES = ("delete", "batch_delete")


@dataclass(frozen=True)
class PhaseStats:
    """One phase: the coordinator's cost, and the ranks' (max and mean over ranks replayed)."""

    coord_requests: int
    coord_cold_requests: int
    coord_requests_no_delete: int
    coord_read: int
    coord_written: int
    coord_seconds: float
    coord_by_kind: dict[str, int]
    ranks: int
    seconds: float  # the whole phase: every actor's steps together
    rank_requests_max: int = 0
    rank_requests_mean: float = 0.0
    rank_read_max: int = 0
    rank_read_mean: float = 0.0
    rank_seconds_max: float = 0.0
    rank_seconds_mean: float = 0.0


@dataclass(frozen=True)
class Measurement:
    """Everything one replay at one W reports."""

    backend: str
    world: int
    seconds: float
    phases: dict[str, PhaseStats]
    load_ranks: int
    load_ratio_max: float  # data bytes read / plan bytes, worst rank
    load_manifest_max: int  # manifest bytes (root, parts) read by one rank, worst rank
    load_metadata_max: int  # DCP .metadata bytes read by one rank
    upload_excess_max: int  # cold requests of a rank's upload minus (1 + 2F), worst rank
    upload_requests_max: int
    files_per_rank: int
    manifest_world: int
    part_ranks: int  # ranks per manifest part the writer was asked for (or the tree's default)
    reader_bytes_read: bool  # whether TieredReader.bytes_read agreed with the counter
    load_manifest_others: int = 0  # the same, over ranks other than 0 (which also resolves)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        phases = {k: PhaseStats(**v) for k, v in data["phases"].items()}
        return cls(**{**data, "phases": phases})


def _phase(run: SimRun, phase: str) -> PhaseStats:
    tallies = run.counter.of(phase)
    coord = tallies.get(COORDINATOR, Tally())
    ranks = [t for actor, t in tallies.items() if actor != COORDINATOR]
    requests = [t.count() for t in ranks] or [0]
    read = [t.read() for t in ranks] or [0]
    secs = [t.seconds for t in ranks] or [0.0]
    no_delete = coord.count() - sum(coord.count(kinds=[k]) for k in DELETES)
    return PhaseStats(
        coord_requests=coord.count(),
        coord_cold_requests=coord.count("cold"),
        coord_requests_no_delete=no_delete,
        coord_read=coord.read(),
        coord_written=coord.bytes_written,
        coord_seconds=round(coord.seconds, 4),
        coord_by_kind=dict(sorted(coord.requests.items())),
        ranks=len(ranks),
        seconds=round(sum(t.seconds for t in tallies.values()), 3),
        rank_requests_max=max(requests),
        rank_requests_mean=round(mean(requests), 2),
        rank_read_max=max(read),
        rank_read_mean=round(mean(read), 1),
        rank_seconds_max=round(max(secs), 4),
        rank_seconds_mean=round(mean(secs), 5),
    )


def _load_ratio(run: SimRun) -> float:
    tallies = run.counter.of("load")
    ratios = [
        tallies[r].read(kinds=["data"]) / need for r, need in run.plan_bytes.items() if need and r in tallies
    ]
    return round(max(ratios), 4) if ratios else 0.0


def _upload(run: SimRun) -> tuple[int, int]:
    """Worst rank's cold requests for its upload, and its excess over ``1 + 2F``."""
    tallies = run.counter.of("cold")
    worst = excess = 0
    for rank, files in run.files_per_rank.items():
        tally = tallies.get(rank)
        if tally is None or not files:
            continue
        sent = tally.count("cold")
        worst, excess = max(worst, sent), max(excess, sent - (1 + 2 * files))
    return worst, excess


def _reader_agrees(run: SimRun) -> bool:
    """``TieredReader.bytes_read`` (where it exists) against the counter, rank by rank."""
    tallies = run.counter.of("load")
    return bool(run.reader_bytes) and all(
        sum(seen.values()) == tallies[rank].read() for rank, seen in run.reader_bytes.items()
    )


def measure(run: SimRun, backend: str, seconds: float) -> Measurement:
    load = run.counter.of("load")
    ranks = [t for actor, t in load.items() if actor != COORDINATOR]
    upload_worst, upload_excess = _upload(run)
    return Measurement(
        backend=backend,
        world=run.config.world,
        seconds=round(seconds, 2),
        phases={p: _phase(run, p) for p in PHASES},
        load_ranks=len(ranks),
        load_ratio_max=_load_ratio(run),
        load_manifest_max=max((t.read(kinds=["manifest"]) for t in ranks), default=0),
        load_manifest_others=max(
            (t.read(kinds=["manifest"]) for actor, t in load.items() if actor > 0), default=0
        ),
        load_metadata_max=max((t.read(kinds=["metadata"]) for t in ranks), default=0),
        upload_excess_max=upload_excess,
        upload_requests_max=upload_worst,
        files_per_rank=max(run.files_per_rank.values(), default=0),
        manifest_world=run.manifest.world_size,
        part_ranks=run.config.part_ranks or tree_part_ranks(),
        reader_bytes_read=_reader_agrees(run),
    )
