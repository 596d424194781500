"""The report's Copies on other nodes tables (``benchmarks/jobs/copies.py``): the save stall
with ``Replicas(2)`` against without, replication throughput against raw gloo, and the
restore of a lost node from its peers against the same bytes from the cold tier.

Every figure is each side's best over its reps with the spread (worst/best) beside it; a
ratio compares two bests measured in the same run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.infra.measure import GiB
from benchmarks.report import analysis as A
from benchmarks.report.tables import size_label, table

STALL_TARGET = 1.10  # the save stall with Replicas(2): within 1.1x of without
THROUGHPUT_TARGET = 0.80  # a replication round: at least 0.8x raw gloo's throughput, same bytes
MEDIA = {"disk": "disk (the scratch directory)", "tmpfs": "tmpfs (`/dev/shm`)"}
VARIANTS = {"plain": "no copies", "replicas": "`Replicas(2)`"}
TRANSFERS = {
    "protect": "a replication round (`Peers.protect`), whole",
    "raw_plan": "raw gloo `send`/`recv`, the round's order",
    "raw_duplex": "raw gloo, both directions at once",
    "raw_disk": "raw gloo both ways, landed on the hot tier's disk (fsync)",
}

Records = Sequence[Mapping[str, Any]]


def _suite(results: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return results["suites"].get("copies") or None


def _records(suite: Mapping[str, Any], phase: str, variant: str, medium: str | None = None) -> list[Any]:
    return [
        r
        for r in suite["records"]
        if r["phase"] == phase
        and r["variant"] == variant
        and r.get("medium") == medium
        and r["rep"] >= 0
        and not r.get("error")
    ]


def _values(records: Records, field: str) -> list[float]:
    return [float(r[field]) for r in records if r.get(field) is not None]


def best(values: Sequence[float]) -> float | None:
    return min(values) if values else None


def cell(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """The best of ``values`` and the spread (worst/best) beside it."""
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    return f"{fmt.format(low)} (spread {high / low:.2f}x)" if low > 0 else fmt.format(low)


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def rates(records: Records, field: str = "seconds") -> list[float]:
    """Aggregate GiB/s of each rep: bytes received on every rank over the slowest rank's time."""
    return [r["received"] / GiB / r[field] for r in records if r.get(field) and r.get("received")]


def verdict(value: float | None, target: float, *, most: bool) -> str:
    if value is None:
        return "n/a"
    met = value <= target if most else value >= target
    return "met" if met else f"**missed** ({value:.2f}x)"


# -- targets -------------------------------------------------------------------------------


def stall_ratio(suite: Mapping[str, Any], field: str = "stall") -> float | None:
    """Best-of-reps ``field`` with Replicas(2) over without."""
    return A.div(
        best(_values(_records(suite, "stall", "replicas"), field)),
        best(_values(_records(suite, "stall", "plain"), field)),
    )


def throughput_ratio(suite: Mapping[str, Any], medium: str, against: str = "raw_plan") -> float | None:
    """A replication round's best throughput over raw gloo's best, the same bytes."""
    return A.div(
        max(rates(_records(suite, "copies", "protect", medium)), default=None),
        max(rates(_records(suite, "copies", against, medium)), default=None),
    )


def restore_ratio(suite: Mapping[str, Any], medium: str, variant: str = "peers") -> float | None:
    """The best restore from the peers (a manager's start) over the best copy from the cold tier."""
    return A.div(
        best(_values(_records(suite, "restore", variant, medium), "seconds")),
        best(_values(_records(suite, "restore", "cold", medium), "seconds")),
    )


def targets_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = _suite(results)
    if suite is None:
        return ""
    size = size_label(int(suite["bytes"]))
    stall = stall_ratio(suite)
    rows = [
        [
            f"save stall, `Replicas(2)` / no copies ({size}, 4 ranks as 2 nodes)",
            ratio(stall),
            f"<= {STALL_TARGET:.2f}x",
            verdict(stall, STALL_TARGET, most=True),
            f"training thread's CPU in `save()` {ratio(stall_ratio(suite, 'save_cpu'))}; "
            f"loop {ratio(stall_ratio(suite, 'loop'))}; "
            f"process CPU {ratio(stall_ratio(suite, 'cpu'))}",
        ]
    ]
    for medium in MEDIA:
        value = throughput_ratio(suite, medium)
        duplex = throughput_ratio(suite, medium, "raw_duplex")
        landed = throughput_ratio(suite, medium, "raw_disk")
        rows.append(
            [
                f"replication throughput, a round / raw gloo of the same bytes, {medium}",
                ratio(value),
                f">= {THROUGHPUT_TARGET:.2f}x",
                verdict(value, THROUGHPUT_TARGET, most=False),
                f"against raw gloo both ways at once {ratio(duplex)}; "
                f"against raw gloo landed on the same disk {ratio(landed)}",
            ]
        )
    for medium in MEDIA:
        rows.append(
            [
                f"restore of a lost node, from the peers (a manager's start) / from the cold tier, {medium}",
                ratio(restore_ratio(suite, medium)),
                "reported",
                "-",
                f"a start with nothing lost / the cold copy {ratio(restore_ratio(suite, medium, 'start'))}",
            ]
        )
    return table(["measure", "ratio (best/best)", "target", "verdict", "beside it"], rows)


# -- the stall -----------------------------------------------------------------------------


def stall_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = _suite(results)
    if suite is None:
        return ""
    rows = []
    for variant, name in VARIANTS.items():
        records = _records(suite, "stall", variant)
        if not records:
            continue
        rows.append(
            [
                name,
                cell(_values(records, "stall")),
                cell(_values(records, "stall_max")),
                cell(_values(records, "save_cpu")),
                cell(_values(records, "compute")),
                cell(_values(records, "loop"), "{:.2f}"),
                cell(_values(records, "settled"), "{:.2f}"),
                cell(_values(records, "cpu"), "{:.1f}"),
                _rounds(records),
            ]
        )
    return table(
        [
            "copies",
            "stall per save, s (a loop's median)",
            "a loop's worst save, s",
            "training thread's CPU in `save()`, s (4 ranks)",
            "a step's compute, s",
            "loop, s",
            "loop until its last copies verified, s",
            "process CPU, s (4 ranks)",
            "background replication rounds",
        ],
        rows,
    )


def _rounds(records: Records) -> str:
    """The background rounds of every loop: how many, their transfers' seconds and rate, and
    how many saves began while the previous save's round still ran."""
    rounds = [one for r in records for one in r.get("rounds") or []]
    if not rounds:
        return "-"
    seconds = [s for s, _ in rounds if s]
    rate = max(moved / GiB / s for s, moved in rounds if s)
    overlapped = sum(int(r.get("overlapped") or 0) for r in records)
    saves = sum(int(r.get("saves") or 0) for r in records)
    return (
        f"{len(rounds)} rounds of {size_label(int(max(m for _, m in rounds)))}: "
        f"{cell(seconds, '{:.2f}')} s, {rate:.2f} GiB/s at best; "
        f"{overlapped} of {saves} saves began during one"
    )


# -- replication throughput ----------------------------------------------------------------


def throughput_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = _suite(results)
    if suite is None:
        return ""
    rows = []
    for medium, where in MEDIA.items():
        raw_best = max(rates(_records(suite, "copies", "raw_plan", medium)), default=None)
        for variant, name in TRANSFERS.items():
            records = _records(suite, "copies", variant, medium)
            if not records:
                continue
            rows.append(_transfer_row(where, name, records, "seconds", raw_best))
            if variant == "protect":
                rows.append(
                    _transfer_row(where, "the same round, its transfers only", records, "transfer", raw_best)
                )
    return table(
        [
            "hot tier",
            "what moves the bytes",
            "bytes received (4 ranks)",
            "seconds (slowest rank)",
            "GiB/s (all ranks)",
            "/ raw gloo, round's order",
            "CPU s per GiB (4 ranks)",
        ],
        rows,
    )


def _transfer_row(where: str, name: str, records: Records, field: str, raw_best: float | None) -> list[str]:
    got = rates(records, field)
    moved = max((r["received"] for r in records), default=0)
    cpu = [r["cpu"] / (r["received"] / GiB) for r in records if r.get("received") and field == "seconds"]
    return [
        where,
        name,
        size_label(int(moved)) if moved else "n/a",
        cell(_values(records, field)),
        "n/a" if not got else f"{max(got):.2f} (spread {max(got) / min(got):.2f}x)",
        ratio(A.div(max(got, default=None), raw_best)),
        cell(cpu, "{:.2f}") if cpu else "-",
    ]


# -- restore -------------------------------------------------------------------------------

RESTORES = {
    "peers": "from the peers: a manager's start (its constructor restores)",
    "start": "a manager's start, nothing lost",
    "cold": "from the cold tier: the same files, `copy_file` (as `tierstore.restore`)",
}


def restore_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = _suite(results)
    if suite is None:
        return ""
    rows = []
    for medium, where in MEDIA.items():
        cold = best(_values(_records(suite, "restore", "cold", medium), "seconds"))
        for variant, name in RESTORES.items():
            records = _records(suite, "restore", variant, medium)
            if not records:
                continue
            moved = max((r["received"] for r in records), default=0)
            seconds = _values(records, "seconds")
            rows.append(
                [
                    where,
                    name,
                    size_label(int(moved)) if moved else "0",
                    cell(seconds),
                    cell(_values(records, "transfer")) if variant != "cold" else "-",
                    "n/a" if not moved or not seconds else f"{moved / GiB / min(seconds):.2f}",
                    cell(_values(records, "cpu"), "{:.2f}"),
                    ratio(A.div(best(seconds), cold)),
                ]
            )
    return table(
        [
            "hot tier",
            "restore",
            "bytes moved (node 1)",
            "seconds (slowest rank)",
            "of which its rounds, s (`Protection.seconds`)",
            "GiB/s",
            "CPU s (4 ranks)",
            "/ from the cold tier",
        ],
        rows,
    )
