"""The perf suite's parts of the report (``benchmarks/jobs/perf_io.py``, ``perf_stall.py``):
the staging paid once (under Stall), the raw encoding's saves (under Save) and its verified
loads (under Load), each with its targets table, its tables and figures.

Every ratio compares the best of the reps of each side (``perf_io``), or medians over the
steady-state saves 2..N (``perf_stall``), all from one run.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.infra.measure import GiB, MiB, Record
from benchmarks.report import analysis as A
from benchmarks.report.tables import image, joined, table

Results = Mapping[str, Any]
RAW_LOADS = ("tiered_raw_t1", "tiered_raw_t4")
OURS = ("ours_reuse", "ours_overlap")
PEERS = ("dcp_async", "torch_checkpointing")
SAVE_ROWS = ("fsw", "tiered_dcp", "tiered_raw", "tiered_raw_direct", "raw_write", "dcp_null")
LOAD_ROWS = ("fsr", "tiered_dcp", "tiered_raw_t1", "tiered_raw_t4")
STALL_ROWS = (
    "sync_tiered",
    "ours_reuse",
    "ours_overlap",
    "ours_fresh",
    "dcp_async",
    "dcp_async_cached",
    "torch_checkpointing",
)


def select(records: Iterable[Record], **where: Any) -> list[Record]:
    return [r for r in records if all(r.get(k) == v for k, v in where.items())]


def best(records: Iterable[Record], field: str, **where: Any) -> dict[str, float]:
    """The smallest ``field`` of each variant's timed reps."""
    out: dict[str, float] = {}
    for r in select(records, **where):
        if r.get(field) is not None and r.get("rep", 0) >= 0 and not r.get("error"):
            out[r["variant"]] = min(out.get(r["variant"], r[field]), r[field])
    return out


def steady(records: Iterable[Record], field: str) -> dict[str, float]:
    """The median ``field`` of each variant's saves 2..N."""
    values: dict[str, list[float]] = {}
    for r in records:
        if not r.get("first") and r.get(field) is not None and not r.get("error"):
            values.setdefault(r["variant"], []).append(r[field])
    return {name: statistics.median(v) for name, v in values.items()}


def first(records: Iterable[Record], field: str) -> dict[str, float]:
    return {r["variant"]: r[field] for r in records if r.get("first") and r.get(field) is not None}


def reasons(records: Iterable[Record]) -> dict[str, str]:
    """Why a variant has no measurement: not in this tree, or failed."""
    return {
        r["variant"]: r.get("unavailable") or f"failed: {r['error']}"
        for r in records
        if r.get("unavailable") or r.get("error")
    }


def pick(values: Mapping[str, float], names: Iterable[str]) -> tuple[str | None, float | None]:
    """The smallest of ``values`` among ``names``."""
    there = [(values[n], n) for n in names if n in values]
    return (min(there)[1], min(there)[0]) if there else (None, None)


def question(key: str) -> str:
    """The report's question a perf target answers, by its key."""
    return "save" if key.startswith("save") else "load" if key.startswith(("load", "crc")) else "stall"


def _target(
    key: str, what: str, value: float | None, op: str, bound: float, detail: str = "", unit: str = "x"
) -> A.Target:
    return A.Target(key, question(key), what, value, op, bound, "design", unit, detail)


def io_targets(io: Mapping[str, Any]) -> list[A.Target]:
    rec = io["records"]
    out = []
    cpu, secs = best(rec, "cpu", op="save", place="tmpfs"), best(rec, "seconds", op="save", place="tmpfs")
    out.append(
        _target(
            "save_cpu",
            "save CPU per GiB, tiered_raw / FileSystemWriter (tmpfs)",
            A.div(cpu.get("tiered_raw"), cpu.get("fsw")),
            "<=",
            0.5,
        )
    )
    out.append(
        _target(
            "save_tmpfs",
            "save throughput on tmpfs, tiered_raw / FileSystemWriter",
            A.div(secs.get("fsw"), secs.get("tiered_raw")),
            ">=",
            1.8,
        )
    )
    disk = best(rec, "seconds", op="save", place="disk")
    arm, took = pick(disk, ("tiered_raw", "tiered_raw_direct"))
    out.append(
        _target(
            "save_disk",
            "save throughput on the disk, TieredWriter raw / raw write+fsync",
            A.div(disk.get("raw_write"), took),
            ">=",
            0.8,
            f"`{arm}`" if arm else "",
        )
    )
    for place, cache in (("tmpfs", "warm"), ("disk", "warm"), ("disk", "cold")):
        where = {"op": "load", "place": place, "cache": cache}
        cpu, secs = best(rec, "cpu", **where), best(rec, "seconds", **where)
        if place == "tmpfs" or cache == "cold":
            arm, value = pick(cpu, RAW_LOADS)
            out.append(
                _target(
                    f"load_cpu_{place}_{cache}",
                    f"load CPU per GiB, TieredReader raw / FileSystemReader ({place}, {cache})",
                    A.div(value, cpu.get("fsr")),
                    "<=",
                    0.5,
                    f"`{arm}`" if arm else "",
                )
            )
        arm, value = pick(secs, RAW_LOADS)
        out.append(
            _target(
                f"load_rate_{place}_{cache}",
                f"load throughput, TieredReader raw / FileSystemReader ({place}, {cache})",
                A.div(secs.get("fsr"), value),
                ">=",
                1.8,
                f"`{arm}`" if arm else "",
            )
        )
    crc = best(rec, "cpu", op="crc")
    share = (
        None
        if "crc_on" not in crc or "crc_off" not in crc
        else (crc["crc_on"] - crc["crc_off"]) / crc["crc_on"]
    )
    out.append(_target("crc_share", "CRC32C share of a raw load's CPU (A/B)", share, "<=", 0.05, unit="%"))
    return out


def stall_targets(stall: Mapping[str, Any]) -> list[A.Target]:
    rec = stall["records"]
    stalls, cpu = steady(rec, "stall"), steady(rec, "cpu")
    out = [
        _target(
            "stall",
            "CheckpointManager steady stall / sync dcp.save (TieredWriter)",
            A.div(stalls.get("ours_reuse"), stalls.get("sync_tiered")),
            "<=",
            0.03,
            "`ours_reuse` (the default)",
        ),
        _target(
            "stall_copy",
            "CheckpointManager steady stall / a copy of the state into buffers that already exist",
            A.div(stalls.get("ours_reuse"), stall.get("copy")),
            "<=",
            1.10,
            "`ours_reuse` (the default)",
        ),
        _target(
            "stall_overlap",
            "CheckpointManager steady stall with overlap_staging / sync dcp.save",
            A.div(stalls.get("ours_overlap"), stalls.get("sync_tiered")),
            "<=",
            0.03,
            "`ours_overlap` (save() returns before the copy, as both peers do)",
        ),
    ]
    arm, ours = pick(stalls, OURS)
    for peer in PEERS:
        out.append(
            _target(
                f"peer_stall_{peer}",
                f"stall, ours / {peer}",
                A.div(ours, stalls.get(peer)),
                "<",
                1.0,
                f"`{arm}`" if arm else "",
            )
        )
        out.append(
            _target(
                f"peer_cpu_{peer}",
                f"CPU per GiB saved, ours / {peer}",
                A.div(cpu.get("ours_reuse"), cpu.get(peer)),
                "<",
                1.0,
                "`ours_reuse`",
            )
        )
    return out


def perf_targets(results: Results) -> list[A.Target]:
    suite = results["suites"].get("perf")
    if not suite:
        return []
    return io_targets(suite["io"]) + stall_targets(suite["stall"])


def met(target: A.Target) -> bool | None:
    if target.value is None:
        return None
    return target.value < target.bound if target.op == "<" else target.met


def verdict(target: A.Target) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met(target)]


# -- the parts ------------------------------------------------------------------------------


def _targets(results: Results, name: str) -> str:
    """The targets table of question ``name``."""
    if not results["suites"].get("perf"):
        return ""
    found = [t for t in perf_targets(results) if t.question == name]
    rows = [[t.what, _value(t), _bound(t), verdict(t), t.detail] for t in found]
    return table(["target", "measured", "bound", "verdict", "ours"], rows)


def stall_targets_part(results: Results, img: Path) -> str:
    return _targets(results, "stall")


def save_targets_part(results: Results, img: Path) -> str:
    return _targets(results, "save")


def load_targets_part(results: Results, img: Path) -> str:
    return _targets(results, "load")


def _value(t: A.Target) -> str:
    return "n/a" if t.value is None else A.fmt_value(t) if t.unit == "%" else f"{t.value:.3f}x"


def _bound(t: A.Target) -> str:
    return f"{t.op} {t.bound:.0%}" if t.unit == "%" else f"{t.op} {t.bound:.2f}x"


def stall_part(results: Results, img: Path | None = None) -> str:
    """Under Stall: the CheckpointManager's staging paid once, against its peers."""
    suite = results["suites"].get("perf")
    return _stall_table(suite["stall"], img) if suite else ""


def save_part(results: Results, img: Path | None = None) -> str:
    """Under Save: the raw encoding's saves."""
    suite = results["suites"].get("perf")
    return _io_tables(suite["io"], img, "save") if suite else ""


def load_part(results: Results, img: Path | None = None) -> str:
    """Under Load: the raw encoding's verified loads and the CRC32C A/B, and any load whose
    check failed."""
    suite = results["suites"].get("perf")
    if not suite:
        return ""
    io = suite["io"]
    checks = [
        f"- `{place}/{name}`: {text}"
        for place, bad in io.get("load_checks", {}).items()
        for name, text in bad.items()
    ]
    return joined(_io_tables(io, img, "load"), "\n".join(checks))


IO_CASES = {
    "save": (("save", (("tmpfs", None), ("disk", None)), SAVE_ROWS),),
    "load": (
        ("load", (("tmpfs", "warm"), ("disk", "warm"), ("disk", "cold")), LOAD_ROWS),
        ("crc", (("tmpfs", None), ("disk", None)), ("crc_on", "crc_off")),
    ),
}
IO_FIGURES = {
    "save": ("perf_save_cpu.png", "CPU seconds per GiB saved, best of reps (lower is better)"),
    "load": ("perf_load_cpu.png", "CPU seconds per GiB loaded, best of reps (lower is better)"),
}


def _io_tables(io: Mapping[str, Any], img: Path | None, part: str) -> str:
    """The save rows (``part`` "save") or the load and CRC32C A/B rows ("load")."""
    rec, scale = io["records"], GiB / io["bytes"]
    rows: list[list[str]] = []
    cpu_bars: dict[str, dict[str, float]] = {}
    missing = reasons(rec)
    for op, places, names in IO_CASES[part]:
        for place, cache in places:
            where = {"op": op, "place": place, **({"cache": cache} if cache else {})}
            cpu, secs = best(rec, "cpu", **where), best(rec, "seconds", **where)
            base = "fsw" if op == "save" else "fsr" if op == "load" else "crc_on"
            label = f"{op} {place}" + (f" {cache}" if cache else "")
            for name in names:
                if name in secs:
                    rows.append(
                        [
                            label,
                            f"`{name}`",
                            f"{io['bytes'] / secs[name] / MiB:.0f}",
                            f"{cpu[name] * scale:.3f}",
                            f"{A.div(secs.get(base), secs[name]) or 0:.2f}x",
                            f"{A.div(cpu[name], cpu.get(base)) or 0:.2f}x",
                        ]
                    )
                    cpu_bars.setdefault(label, {})[name] = cpu[name] * scale
                elif name in missing and select(rec, variant=name, op=op, place=place):
                    rows.append([label, f"`{name}`", "n/a", "n/a", "", missing[name][:120]])
    out = [
        table(["case", "variant", "MiB/s (best)", "CPU s/GiB (best)", "speed vs base", "CPU vs base"], rows)
    ]
    if img is not None and cpu_bars:
        from benchmarks.report import plots  # matplotlib: only where a figure is drawn

        name, title = IO_FIGURES[part]
        path = plots.bars(img / name, title, "CPU s/GiB", cpu_bars)
        out.append(image(path, f"CPU per GiB of the {part}s"))
    return joined(*out)


def _stall_table(stall: Mapping[str, Any], img: Path | None) -> str:
    rec, scale = stall["records"], GiB / stall["bytes"]
    fields = ("stall", "staged", "durable", "cpu")
    med = {f: steady(rec, f) for f in fields}
    one = {f: first(rec, f) for f in fields}
    missing = reasons(rec)
    rows: list[list[str]] = []
    bars: dict[str, dict[str, float]] = {}
    for name in STALL_ROWS:
        if name in med["stall"]:
            rows.append(
                [
                    f"`{name}`",
                    *[f"{med[f][name]:.3f}" for f in fields[:3]],
                    f"{med['cpu'][name] * scale:.3f}",
                    f"{A.div(med['stall'][name], med['stall'].get('sync_tiered')) or 0:.3f}x",
                    " / ".join(f"{one[f].get(name, 0):.3f}" for f in fields[:3]),
                ]
            )
            bars.setdefault("stall", {})[name] = med["stall"][name]
            bars.setdefault("staged", {})[name] = med["staged"][name]
            bars.setdefault("durable", {})[name] = med["durable"][name]
        elif name in missing:
            rows.append([f"`{name}`", "n/a", "n/a", "n/a", "n/a", "", missing[name][:300]])
    out = [
        table(
            [
                "system",
                "stall s",
                "staged s",
                "durable s",
                "CPU s/GiB",
                "stall / sync",
                "first save: stall / staged / durable s",
            ],
            rows,
        )
    ]
    if img is not None and bars:
        from benchmarks.report import plots  # matplotlib: only where a figure is drawn

        path = plots.bars(
            img / "perf_stall.png", "Seconds per save, steady state (log)", "seconds", bars, log=True
        )
        out.append(image(path, "stall, staged and durable per system"))
    return joined(*out)
