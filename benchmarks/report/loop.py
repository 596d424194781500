"""The report's training-loop part: saves and loads between steps, every rep shown
(``benchmarks/jobs/perf_loop.py``), each writer and reader against the floor measured in the
same run."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import Lines, size_label, table
from benchmarks.report.template import paragraph

Records = list[dict[str, Any]]
SAVES = {"fsw": "FileSystemWriter", "tiered": "TieredWriter", "floor": "floor"}
LOADS = {"fsr": "FileSystemReader", "tiered": "TieredReader", "floor": "floor"}
# (op, variant, bound of its best CPU over the floor's best, what the bound is)
TARGETS = (
    (
        "save",
        "tiered",
        1.10,
        "verified save CPU, TieredWriter / floor (one copy into the page cache + one CRC32C pass)",
    ),
    (
        "load",
        "tiered",
        1.05,
        "verified load CPU, TieredReader / floor (one copy out of the page cache + one CRC32C pass)",
    ),
)
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


def loop_targets(records: Records) -> list[list[str]]:
    """Rows of the targets table: each bound against the floor, and each side's spread."""
    rows = []
    for op, variant, bound, what in TARGETS:
        ratio = A.div(
            min(_runs(records, op, variant), default=None), min(_runs(records, op, "floor"), default=None)
        )
        rows.append(
            _verdict(
                what + " (best of the loop's reps)",
                ratio,
                f"<= {bound:.2f}x",
                ratio is not None and ratio <= bound,
            )
        )
    for op, names in (("save", SAVES), ("load", LOADS)):
        for variant, label in names.items():
            value = spread(_runs(records, op, variant))
            rows.append(
                _verdict(
                    f"{op} CPU spread over the loop, {label} (worst rep / best rep)",
                    value,
                    f"<= {SPREAD:.2f}x",
                    value is not None and value <= SPREAD,
                )
            )
    return rows


def _verdict(what: str, value: float | None, bound: str, met: bool) -> list[str]:
    return [what, "n/a" if value is None else f"{value:.2f}x", bound, "met" if met else "**missed**"]


def _cell(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    return f"{record['cpu']:.3f} ({record['sys']:.2f} sys)"


def _rep_rows(records: Records) -> list[list[str]]:
    columns = [("save", v) for v in SAVES] + [("load", v) for v in LOADS]
    found = {column: _by_rep(records, *column) for column in columns}
    reps = sorted({rep for per in found.values() for rep in per})
    rows = []
    for rep in reps:
        reported = sum(per[rep].get("reported_mib", 0.0) for per in found.values() if rep in per)
        rows.append([str(rep), *(_cell(found[c].get(rep)) for c in columns), f"{reported:.0f}"])
    return rows


def _summary_rows(records: Records) -> list[list[str]]:
    rows = []
    for op, names in (("save", SAVES), ("load", LOADS)):
        floor = min(_runs(records, op, "floor"), default=None)
        for variant, label in names.items():
            cpu = _runs(records, op, variant)
            if not cpu:
                continue
            best, median, worst = min(cpu), statistics.median(cpu), max(cpu)
            ratio = A.div(best, floor)
            rows.append(
                [
                    f"{op}, {label}",
                    f"{best:.3f}",
                    f"{median:.3f}",
                    f"{worst:.3f}",
                    f"{worst / best:.2f}x" if best > 0 else "n/a",
                    "n/a" if ratio is None else f"{ratio:.2f}x",
                    f"{min(_runs(records, op, variant, 'seconds')):.3f}",
                ]
            )
    return rows


def _pages_rows(records: Records) -> list[list[str]]:
    rows = []
    for variant, what in (
        ("reused", "into pages it frees and takes again (one file rewritten)"),
        ("new", "into new pages (a file kept per write)"),
    ):
        runs = [r for r in records if r["op"] == "pages" and r["variant"] == variant]
        if runs:
            sys_times = [r["sys"] for r in runs]
            reported = sum(r.get("reported_mib", 0.0) for r in runs)
            rows.append([what, f"{min(sys_times):.3f} .. {max(sys_times):.3f}", f"{reported:.0f}"])
    return rows


def loop_section(suite: Mapping[str, Any]) -> Lines:
    loop = suite.get("loop")
    if not loop or not loop.get("records"):
        return []
    records = loop["records"]
    return paragraph(
        "perf.loop",
        size=size_label(loop["bytes"]),
        reps=loop["reps"],
        reps_table=table(
            [
                "rep",
                *(f"save {v}" for v in SAVES.values()),
                *(f"load {v}" for v in LOADS.values()),
                "MiB handed back to the host",
            ],
            _rep_rows(records),
        ),
        summary=table(
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
        ),
        pages=table(
            ["the same bytes written", "system CPU per write, s", "MiB handed back to the host"],
            _pages_rows(records),
        ),
        targets=table(["measure", "value", "target", "verdict"], loop_targets(records)),
    )
