"""Under Save: saves and loads the way a training loop runs them, every rep shown
(``benchmarks/jobs/perf_loop.py``), each writer and reader against the floor measured in the
same run."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import joined, table

Records = list[dict[str, Any]]
SAVES = {
    "fsw": "FileSystemWriter",
    "tiered": "TieredWriter",
    "floor": "floor",
}
LOADS = {
    "fsr": "FileSystemReader",
    "tiered": "TieredReader",
    "floor": "floor",
    "dcp_null": "DCP alone (reads no data)",
}
SPREAD = 1.5  # the steadiness asked of a save and a load: worst rep / best rep over the loop


def _runs(records: Records, op: str, variant: str, field: str = "cpu") -> list[float]:
    return [
        r[field]
        for r in records
        if r["op"] == op and r["variant"] == variant and r["rep"] >= 0 and field in r
    ]


def _by_rep(records: Records, op: str, variant: str) -> dict[int, dict[str, Any]]:
    return {r["rep"]: r for r in records if r["op"] == op and r["variant"] == variant and r["rep"] >= 0}


def spread(values: list[float]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


def worst_against(records: Records, op: str, variant: str, base: str) -> tuple[float | None, int | None]:
    """The largest ratio of ``variant``'s CPU to ``base``'s in the same rep, and that rep."""
    ours, theirs = _by_rep(records, op, variant), _by_rep(records, op, base)
    ratios = {
        rep: ours[rep]["cpu"] / theirs[rep]["cpu"] for rep in ours if rep in theirs and theirs[rep]["cpu"] > 0
    }
    if not ratios:
        return None, None
    rep = max(ratios, key=lambda r: ratios[r])
    return ratios[rep], rep


def loop_targets(records: Records) -> list[A.Target]:
    def best_over_floor(op: str) -> float | None:
        return A.div(
            min(_runs(records, op, "tiered"), default=None), min(_runs(records, op, "floor"), default=None)
        )

    return [
        A.Target(
            "save_loop_floor",
            "save",
            "save CPU, TieredWriter / floor (one copy into the page cache + one CRC32C pass), best reps",
            best_over_floor("save"),
            "<=",
            1.10,
            "design",
        ),
        A.Target(
            "save_loop_fsw",
            "save",
            "save CPU, TieredWriter / FileSystemWriter in the same rep, the worst rep",
            worst_against(records, "save", "tiered", "fsw")[0],
            "<=",
            1.00,
            "design",
        ),
        A.Target(
            "save_loop_spread",
            "save",
            "save CPU spread over the loop, TieredWriter (worst rep / best rep)",
            spread(_runs(records, "save", "tiered")),
            "<=",
            SPREAD,
            "design",
        ),
        A.Target(
            "load_loop_floor",
            "load",
            "load CPU, TieredReader / floor (one copy out of the page cache + one CRC32C pass), best reps",
            best_over_floor("load"),
            "<=",
            1.05,
            "design",
        ),
        A.Target(
            "load_loop_fsr",
            "load",
            "load CPU, TieredReader / FileSystemReader in the same rep, the worst rep",
            worst_against(records, "load", "tiered", "fsr")[0],
            "<=",
            1.00,
            "design",
        ),
        A.Target(
            "load_loop_spread",
            "load",
            "load CPU spread over the loop, TieredReader (worst rep / best rep)",
            spread(_runs(records, "load", "tiered")),
            "<=",
            SPREAD,
            "design",
        ),
    ]


def _cell(record: dict[str, Any] | None) -> str:
    return "-" if record is None else f"{record['cpu']:.3f} ({record['sys']:.2f})"


def _rep_rows(records: Records) -> list[list[str]]:
    columns = [("save", v) for v in SAVES] + [("load", v) for v in LOADS]
    found = {
        column: {r["rep"]: r for r in records if (r["op"], r["variant"]) == column} for column in columns
    }
    rows = []
    for rep in sorted({rep for per in found.values() for rep in per}):
        reported = sum(per[rep].get("reported_mib", 0.0) for per in found.values() if rep in per)
        label = f"{rep} (warm-up)" if rep < 0 else str(rep)
        rows.append([label, *(_cell(found[c].get(rep)) for c in columns), f"{reported:.0f}"])
    return rows


def _summary_rows(records: Records) -> list[list[str]]:
    rows = []
    for op, names in (("save", SAVES), ("load", LOADS)):
        floor = min(_runs(records, op, "floor"), default=None)
        for variant, label in names.items():
            cpu = _runs(records, op, variant)
            if not cpu:
                continue
            ratio = A.div(min(cpu), floor)
            rows.append(
                [
                    f"{op}, {label}",
                    f"{min(cpu):.3f}",
                    f"{statistics.median(cpu):.3f}",
                    f"{max(cpu):.3f}",
                    "n/a" if spread(cpu) is None else f"{spread(cpu):.2f}x",
                    "n/a" if ratio is None else f"{ratio:.2f}x",
                    f"{min(_runs(records, op, variant, 'seconds')):.3f}",
                ]
            )
    return rows


def _pages_rows(records: Records) -> list[list[str]]:
    rows = []
    for variant, what in (
        ("reused", "over the pages of a file, overwritten in place"),
        ("new", "into new pages, a new file kept per write"),
    ):
        runs = [r for r in records if r["op"] == "pages" and r["variant"] == variant]
        if runs:
            sys_times = [r["sys"] for r in runs]
            reported = sum(r.get("reported_mib", 0.0) for r in runs)
            rows.append([what, f"{min(sys_times):.3f} .. {max(sys_times):.3f}", f"{reported:.0f}"])
    return rows


def _verdict(t: A.Target) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[t.met]


def _loop(results: Mapping[str, Any]) -> Records:
    """The loop job's records, or [] without them."""
    loop = (results["suites"].get("perf") or {}).get("loop") or {}
    return list(loop.get("records") or [])


def targets_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    records = _loop(results)
    if not records:
        return ""
    rows = [
        [t.what, "n/a" if t.value is None else f"{t.value:.2f}x", f"{t.op} {t.bound:.2f}x", _verdict(t)]
        for t in loop_targets(records)
    ]
    return table(["target", "measured", "bound", "verdict"], rows)


def reps_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    """CPU seconds (system time in parentheses) of every rep, then best, median and worst."""
    records = _loop(results)
    if not records:
        return ""
    reps = table(
        [
            "rep",
            *(f"save {v}" for v in SAVES.values()),
            *(f"load {v}" for v in LOADS.values()),
            "MiB handed to the host",
        ],
        _rep_rows(records),
    )
    summary = table(
        [
            "CPU seconds",
            "best",
            "median",
            "worst",
            "spread (worst/best)",
            "best / floor's best",
            "best wall, s",
        ],
        _summary_rows(records),
    )
    return joined(reps, summary)


def pages_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    """The page phase: the same bytes written over reused pages and into new ones."""
    records = _loop(results)
    rows = _pages_rows(records)
    if not rows:
        return ""
    return table(["the same bytes written", "system CPU per write, s", "MiB handed to the host"], rows)
