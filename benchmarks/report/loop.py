"""Under Save: saves and loads the way a training loop runs them, every rep shown
(``benchmarks/jobs/perf_loop.py``), each writer and reader against the floor measured in the
same run."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import Lines, size_label, table
from benchmarks.report.template import block, paragraph

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


def loop_why(target: A.Target, records: Records, suite: Mapping[str, Any] | None = None) -> str:
    """Why a loop target missed, from this run's reps."""
    op = target.key.split("_")[0]
    if target.value is None:
        return block("perf.loop.why.unmeasured")
    ours, floor = _runs(records, op, "tiered"), _runs(records, op, "floor")
    worst_rep = max(_by_rep(records, op, "tiered").items(), key=lambda kv: kv[1]["cpu"])
    rep, record = worst_rep
    if op == "load":  # DCP alone, measured in the same loop
        dcp_own = min(_runs(records, "load", "dcp_null"), default=None)
    else:  # the save's, measured by the raw encoding's job of the same run
        io = (suite or {}).get("io") or {}
        dcp_own = min(
            (
                r["cpu"]
                for r in io.get("records", [])
                if r.get("variant") == "dcp_null" and "cpu" in r and r.get("rep", 0) >= 0
            ),
            default=None,
        )
    return block(
        "perf.loop.why",
        op=op,
        who="TieredWriter" if op == "save" else "TieredReader",
        best=f"{min(ours):.3f}",
        median=f"{statistics.median(ours):.3f}",
        worst=f"{record['cpu']:.3f}",
        worst_sys=f"{record['sys']:.3f}",
        rep=rep,
        floor_best=f"{min(floor):.3f}" if floor else "n/a",
        floor_spread="n/a" if spread(floor) is None else f"{spread(floor):.2f}x",
        remainder="n/a" if not floor else f"{min(ours) - min(floor):+.3f}",
        parts=block(
            f"perf.loop.why.{op}",
            dcp_own="n/a" if dcp_own is None else f"{dcp_own:.3f}",
            ours_beyond="n/a" if not floor or dcp_own is None else f"{min(ours) - min(floor) - dcp_own:+.3f}",
        ),
        reported=f"{record.get('reported_mib', 0.0):.0f}",
    )


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


def _pages_now(records: Records) -> str:
    """What this run's own page phase and loop showed: whether new pages were dearer here, and
    how each writer's saves swung."""
    sys_of = {
        variant: [r["sys"] for r in records if r["op"] == "pages" and r["variant"] == variant]
        for variant in ("reused", "new")
    }
    if not all(sys_of.values()):
        return ""
    ratio = A.div(statistics.median(sys_of["new"]), statistics.median(sys_of["reused"]))
    steady = [r for r in records if r["op"] in ("save", "load") and r["rep"] >= 0]
    handed = sum(r.get("reported_mib", 0.0) for r in steady)
    size = max((r.get("bytes", 0) for r in steady), default=0) / (1 << 20)
    swings = ", ".join(
        f"{label} {spread(_runs(records, 'save', variant)):.2f}x"
        for variant, label in (("fsw", "FileSystemWriter"), ("tiered", "TieredWriter"))
        if spread(_runs(records, "save", variant)) is not None
    )
    said = (
        f"In this run new pages cost {'n/a' if ratio is None else f'{ratio:.2f}x'} the system time "
        f"of reused ones (medians), and the host took {handed:.0f} MiB back over the loop's reps"
    )
    if ratio is not None and ratio < 1.25 and handed < size / 2:
        said += ": it reclaimed little while this ran, so new pages were hardly dearer"
    else:
        said += ": whoever wrote into new pages paid for it"
    return said + (f" (save spread over the loop: {swings})." if swings else ".")


def _verdict(t: A.Target) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[t.met]


def perf_loop_section(results: Mapping[str, Any], img: Path | None = None) -> Lines:
    """Under Save: the training-shaped loop."""
    suite = results["suites"].get("perf")
    loop = (suite or {}).get("loop")
    if not loop or not loop.get("records"):
        return []
    records = loop["records"]
    found = loop_targets(records)
    out = paragraph(
        "perf.loop",
        size=size_label(loop["bytes"]),
        reps=loop["reps"],
        targets=table(
            ["target", "measured", "bound", "verdict"],
            [
                [
                    t.what,
                    "n/a" if t.value is None else f"{t.value:.2f}x",
                    f"{t.op} {t.bound:.2f}x",
                    _verdict(t),
                ]
                for t in found
            ],
        ),
        reps_table=table(
            [
                "rep",
                *(f"save {v}" for v in SAVES.values()),
                *(f"load {v}" for v in LOADS.values()),
                "MiB handed to the host",
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
            ["the same bytes written", "system CPU per write, s", "MiB handed to the host"],
            _pages_rows(records),
        ),
        pages_now=_pages_now(records),
    )
    missed = [t for t in found if t.met is not True]
    if missed:
        out += paragraph("perf.missed")
        out += [
            block(
                "perf.miss",
                what=t.what,
                value="n/a" if t.value is None else f"{t.value:.2f}x",
                bound=f"{t.op} {t.bound:.2f}x",
                why=loop_why(t, records, suite),
            )
            for t in missed
        ] + [""]
    return out
