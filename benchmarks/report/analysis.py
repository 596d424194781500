"""From raw records to the numbers the report states: medians, ratios, best-ofs, targets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.infra.measure import GiB, MiB, Record
from benchmarks.infra.stats import by_variant, paired_ratios
from benchmarks.report.tables import QUESTIONS

Summaries = dict[str, dict[str, float]]
Results = Mapping[str, Any]


@dataclass(frozen=True)
class Target:
    """One stated target: ``value`` compared with ``bound`` (``>=`` or ``<=``)."""

    key: str  # stable name, for the notes on a miss
    question: str  # the report's question it answers: a key of ``tables.QUESTIONS``
    what: str
    value: float | None
    op: str
    bound: float
    source: str  # "design" (a design target) or "ours" (a criterion this report adds)
    unit: str = "x"
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.bound if self.op == ">=" else self.value <= self.bound


def med(summaries: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    entry = summaries.get(name)
    return None if entry is None else entry["median"]


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def rates(records: Iterable[Record], field: str) -> list[Record]:
    """Records with ``rate`` = bytes / ``field`` (a duration) added."""
    return [
        {**r, "rate": r["bytes"] / r[field]}
        for r in records
        if r.get(field) and r.get("bytes") and not r.get("error")
    ]


def throughput(records: Iterable[Record], field: str) -> Summaries:
    return by_variant(rates(records, field), "rate")


def cpu_per_gib(records: Iterable[Record]) -> Summaries:
    """CPU seconds (all ranks, all threads) per GiB saved or loaded, per variant."""
    per = [
        {**r, "cpu_gib": r["cpu"] / r["bytes"] * GiB}
        for r in records
        if r.get("cpu") and r.get("bytes") and not r.get("error")
    ]
    return by_variant(per, "cpu_gib")


def cpu_note(records: Iterable[Record], num: str, den: str) -> str:
    """``CPU <num>/<den> = r``: the steadier companion of a wall-time ratio."""
    cpu = cpu_per_gib(records)
    value = div(med(cpu, num), med(cpu, den))
    return "" if value is None else f"; CPU time {value:.2f}x"


def band(records: Iterable[Record], field: str, num: str, den: str, *, invert: bool = False) -> str:
    """The per-rep range of a ratio of two variants measured back to back."""
    pair = paired_ratios(records, field, den, num) if invert else paired_ratios(records, field, num, den)
    if pair is None:
        return ""
    return f"per-rep {pair['min']:.2f}x .. {pair['max']:.2f}x"


# -- the save suite: stall, hot throughput, save memory ----------------------------------------


def save_sizes(results: Results) -> list[int]:
    return sorted(int(size) for size in results["suites"].get("save", {}) if size.isdigit())


def save_records(results: Results, size: int) -> list[Record]:
    return list(results["suites"]["save"][str(size)])


def largest_with(results: Results, variant: str) -> int | None:
    sizes = [
        s
        for s in save_sizes(results)
        if any(r["variant"] == variant and not r.get("error") for r in save_records(results, s))
    ]
    return max(sizes) if sizes else None


def stall_targets(results: Results) -> list[Target]:
    size = largest_with(results, "fsspec_sync") or largest_with(results, "fsw_sync")
    if size is None:
        return []
    stall = by_variant(save_records(results, size), "stall")
    label = f"{size // MiB} MiB, 2 ranks"
    tiered = med(stall, "tiered_async")
    out = [
        Target(
            "stall_fsw_async",
            "stall",
            f"save stall, TieredWriter async / FileSystemWriter async ({label})",
            div(tiered, med(stall, "fsw_async")),
            "<=",
            1.1,
            "ours",
        ),
        Target(
            "stall_fsw_sync",
            "stall",
            f"save stall, TieredWriter async / FileSystemWriter sync ({label})",
            div(tiered, med(stall, "fsw_sync")),
            "<=",
            0.5,
            "ours",
        ),
    ]
    if "fsspec_sync" in stall:
        out.append(
            Target(
                "stall_fsspec_sync",
                "stall",
                f"save stall, TieredWriter async / FsspecWriter sync to S3 ({label})",
                div(tiered, med(stall, "fsspec_sync")),
                "<=",
                0.5,
                "ours",
            )
        )
    return out


def hot_targets(results: Results) -> list[Target]:
    out = []
    for size in save_sizes(results):
        records = save_records(results, size)
        rate = throughput(records, "commit")
        label = f"{size // MiB} MiB, 2 ranks"
        out.append(
            Target(
                "hot_fsw",
                "save",
                f"hot write throughput, TieredWriter / FileSystemWriter ({label})",
                div(med(rate, "tiered_sync"), med(rate, "fsw_sync")),
                ">=",
                1.0,
                "design",
                detail=band(records, "commit", "tiered_sync", "fsw_sync", invert=True)
                + cpu_note(records, "tiered_sync", "fsw_sync"),
            )
        )
        out.append(
            Target(
                "hot_disk",
                "save",
                f"hot write throughput, TieredWriter / disk write+fsync ({label})",
                div(med(rate, "tiered_sync"), med(rate, "disk_sync")),
                ">=",
                0.8,
                "design",
                detail=band(records, "commit", "tiered_sync", "disk_sync", invert=True),
            )
        )
    return out


def memory_targets(results: Results) -> list[Target]:
    size = largest_with(results, "tiered_sync")
    if size is None:
        return []
    growth = by_variant(save_records(results, size), "growth_save")
    label = f"{size // MiB} MiB, 2 ranks"
    return [
        Target(
            "memory_save_sync",
            "memory",
            f"save peak RSS growth, TieredWriter / FileSystemWriter, sync ({label})",
            div(med(growth, "tiered_sync"), med(growth, "fsw_sync")),
            "<=",
            1.1,
            "ours",
        ),
        Target(
            "memory_save_async",
            "memory",
            f"save peak RSS growth, TieredWriter / FileSystemWriter, async ({label})",
            div(med(growth, "tiered_async"), med(growth, "fsw_async")),
            "<=",
            1.1,
            "ours",
        ),
    ]


def cpu_costs(results: Results) -> Summaries:
    """CPU seconds per GiB of each CPU-only measurement (median, min, max)."""
    suite = results["suites"].get("cpu")
    if not suite:
        return {}
    per = [{**r, "per_gib": r["cpu"] / r["bytes"] * GiB} for r in suite["records"]]
    return by_variant(per, "per_gib")


def cpu_targets(results: Results) -> list[Target]:
    costs = cpu_costs(results)
    if "fsw_tmpfs" not in costs:
        return []
    records = results["suites"]["cpu"]["records"]
    fsw = med(costs, "fsw_tmpfs")
    return [
        Target(
            "hot_tmpfs",
            "save",
            "hot write throughput, TieredWriter / FileSystemWriter, tmpfs (CPU-bound, one process)",
            div(fsw, med(costs, "tiered_tmpfs")),
            ">=",
            1.0,
            "design",
            detail=band(records, "cpu", "fsw_tmpfs", "tiered_tmpfs"),
        )
    ]


# -- stall vs cold-tier latency ----------------------------------------------------------------


def latency_summary(results: Results, field: str = "stall") -> dict[str, dict[int, float]]:
    """``{writer: {added ms: median of field}}``."""
    suite = results["suites"].get("latency")
    if not suite:
        return {}
    out: dict[str, dict[int, float]] = {}
    for label, summary in by_variant(suite["records"], field).items():
        writer, ms = label.split("@")
        out.setdefault(writer, {})[int(ms.removesuffix("ms"))] = summary["median"]
    return out


def latency_targets(results: Results) -> list[Target]:
    table = latency_summary(results)
    out = []
    for writer, op, bound, what in (
        ("tiered_async", "<=", 1.25, "stays flat"),
        ("fsspec_sync", ">=", 1.25, "grows"),
    ):
        series = table.get(writer, {})
        top = max(series) if series else None
        value = div(series.get(top), series.get(0)) if top else None
        out.append(
            Target(
                f"latency_{writer}",
                "stall",
                f"stall at +{top} ms / at +0 ms, {writer} ({what})",
                value,
                op,
                bound,
                "ours",
            )
        )
    return out


# -- migration: throughput and memory ----------------------------------------------------------


def migration_rates(results: Results) -> dict[str, dict[int, dict[str, float]]]:
    """``{kind: {parts in flight: summary of MiB/s}}`` for the sweep."""
    suite = results["suites"].get("migration")
    if not suite:
        return {}
    out: dict[str, dict[int, dict[str, float]]] = {}
    sweep = [r for r in suite["records"] if r["group"] == "sweep"]
    for inflight in sorted({r["inflight"] for r in sweep}):
        subset = [r for r in sweep if r["inflight"] == inflight]
        for kind, summary in throughput(subset, "seconds").items():
            out.setdefault(kind, {})[inflight] = {k: v / MiB if k != "n" else v for k, v in summary.items()}
    return out


def migration_memory(results: Results) -> dict[str, dict[int, float]]:
    """``{kind: {bytes: median peak RSS growth}}`` at the default parts in flight."""
    suite = results["suites"].get("migration")
    if not suite:
        return {}
    default = suite["default_inflight"]
    grouped: dict[str, dict[int, list[float]]] = {}
    for r in suite["records"]:
        if r["inflight"] == default and r.get("growth") is not None and not r.get("error"):
            grouped.setdefault(r["variant"], {}).setdefault(r["bytes"], []).append(r["growth"])
    return {
        kind: {size: sorted(v)[len(v) // 2] for size, v in sizes.items()} for kind, sizes in grouped.items()
    }


def migration_targets(results: Results) -> list[Target]:
    suite = results["suites"].get("migration")
    if not suite:
        return []
    speed = migration_rates(results)
    default = suite["default_inflight"]
    sweep = [r for r in suite["records"] if r["group"] == "sweep" and r["inflight"] == default]
    out = [
        Target(
            "migration",
            "migration",
            f"migration throughput, migrate_pending / s3fs put_file "
            f"({default} parts in flight, same part size)",
            div(
                speed.get("tiered", {}).get(default, {}).get("median"),
                speed.get("s3fs", {}).get(default, {}).get("median"),
            ),
            ">=",
            0.9,
            "design",
            detail=band(sweep, "seconds", "tiered", "s3fs", invert=True) + cpu_note(sweep, "tiered", "s3fs"),
        )
    ]
    memory = migration_memory(results)
    ours, plain = memory.get("tiered", {}), memory.get("s3fs", {})
    if len(ours) >= 2:
        # The upload pipeline holds at most parts-in-flight x part size per file (plus the
        # read-ahead); a checkpoint smaller than that never fills it. Flat means: past the
        # fill, doubling (or more) the checkpoint leaves memory where it was.
        small, large = sorted(ours)[-2:]
        out.append(
            Target(
                "migration_memory_flat",
                "memory",
                f"migrator peak RSS growth, {large // MiB} MiB / {small // MiB} MiB checkpoint (flat)",
                div(ours[large], ours[small]),
                "<=",
                1.25,
                "ours",
            )
        )
    common = sorted(set(ours) & set(plain))
    if common:
        size = common[-1]
        out.append(
            Target(
                "migration_memory",
                "memory",
                f"migration peak RSS growth, migrate_pending / "
                f"s3fs put_file ({size // MiB} MiB, {default} parts in flight)",
                div(ours[size], plain[size]),
                "<=",
                1.5,
                "ours",
            )
        )
    return out


# -- loads -------------------------------------------------------------------------------------


def load_summary(results: Results) -> Summaries:
    suite = results["suites"].get("load")
    return by_variant(suite["records"], "load") if suite else {}


def load_targets(results: Results) -> list[Target]:
    suite = results["suites"].get("load")
    if not suite:
        return []
    t = load_summary(results)
    records = suite["records"]
    out = [
        Target(
            "load_hot",
            "load",
            "hot load throughput, TieredReader / FileSystemReader, page cache dropped",
            div(med(t, "fsr_hot"), med(t, "tiered_hot")),
            ">=",
            1.0,
            "design",
            detail=band(records, "load", "fsr_hot", "tiered_hot")
            + cpu_note(records, "tiered_hot", "fsr_hot"),
        ),
        Target(
            "load_hot_warm",
            "load",
            "hot load throughput, TieredReader / FileSystemReader, warm page cache",
            div(med(t, "fsr_hot_warm"), med(t, "tiered_hot_warm")),
            ">=",
            1.0,
            "design",
            detail=band(records, "load", "fsr_hot_warm", "tiered_hot_warm")
            + cpu_note(records, "tiered_hot_warm", "fsr_hot_warm"),
        ),
        Target(
            "load_cold",
            "load",
            "cold-only load throughput, TieredReader / FsspecReader (S3)",
            div(med(t, "fsspec_cold"), med(t, "tiered_cold")),
            ">=",
            0.9,
            "design",
            detail=band(records, "load", "fsspec_cold", "tiered_cold")
            + cpu_note(records, "tiered_cold", "fsspec_cold"),
        ),
        Target(
            "crc",
            "load",
            "checksum cost: CRC32C time / hot load time (warm page cache, the worst case)",
            div(med(t, "crc_only"), med(t, "tiered_hot_warm")),
            "<=",
            0.05,
            "design",
            unit="%",
        ),
    ]
    # CPU seconds, not wall time: a few percent is below the wall-time noise of this VM.
    ab = paired_ratios(records, "cpu", "tiered_hot_warm", "tiered_hot_nocrc_warm")
    if ab is not None:
        out.append(
            Target(
                "crc_ab",
                "load",
                "checksum cost, A/B: CPU time of a hot load (warm) with / without CRC32C - 1",
                ab["median"] - 1,
                "<=",
                0.05,
                "design",
                unit="%",
                detail=f"per-rep {ab['min'] - 1:+.0%} .. {ab['max'] - 1:+.0%}",
            )
        )
    return out


# -- scaling, GPU staging ----------------------------------------------------------------------


def scaling_table(results: Results, field: str = "commit") -> dict[int, Summaries]:
    suite = results["suites"].get("scaling")
    if not suite:
        return {}
    return {int(world): by_variant(records, field) for world, records in suite["by_ranks"].items()}


def scaling_targets(results: Results) -> list[Target]:
    suite = results["suites"].get("scaling")
    out = []
    for world, commit in sorted(scaling_table(results).items()):
        records = suite["by_ranks"][str(world)]
        out.append(
            Target(
                f"scaling_{world}",
                "scale",
                f"time to commit, TieredWriter / FileSystemWriter, sync, {world} rank(s)",
                div(med(commit, "tiered_sync"), med(commit, "fsw_sync")),
                "<=",
                1.0,
                "ours",
                detail=band(records, "commit", "tiered_sync", "fsw_sync")
                + cpu_note(records, "tiered_sync", "fsw_sync"),
            )
        )
    return out


def gpu_targets(results: Results) -> list[Target]:
    gpu = results["suites"].get("gpu")
    if not gpu or gpu.get("skipped"):
        return []
    stall = by_variant(gpu["records"], "stall")
    return [
        Target(
            "gpu_pinned",
            "stall",
            "async_save stall, pinned async staging / DCP default stager",
            div(med(stall, "pinned_async"), med(stall, "dcp_default")),
            "<=",
            1.0,
            "ours",
        )
    ]


def all_targets(results: Results) -> list[Target]:
    found: list[Target] = []
    for rule in (
        stall_targets,
        latency_targets,
        hot_targets,
        cpu_targets,
        migration_targets,
        load_targets,
        memory_targets,
        scaling_targets,
        gpu_targets,
    ):
        found.extend(rule(results))
    order = list(QUESTIONS)
    return sorted(found, key=lambda t: order.index(t.question))  # stable: grouped by question


def fsync_share(records: Iterable[Record]) -> dict[str, float] | None:
    """The share of the disk baseline's time spent in fsync (``median``, ``min``, ``max``):
    near 0, the page cache absorbed the writes and the baseline ran at memory speed. The
    median of an even count is the upper middle value."""
    shares = sorted(
        r["fsync"] / r["commit"]
        for r in records
        if r.get("variant") == "disk_sync" and r.get("fsync") and r.get("commit")
    )
    if not shares:
        return None
    return {"median": shares[len(shares) // 2], "min": shares[0], "max": shares[-1]}


# -- saves with the cold tier down -------------------------------------------------------------


def best_of(records: Iterable[Record], field: str) -> dict[str, float]:
    """The smallest value of ``field`` per variant over its reps (errors left out)."""
    out: dict[str, float] = {}
    for record in records:
        value = record.get(field)
        if value is not None and not record.get("error"):
            name = str(record["variant"])
            out[name] = min(out.get(name, value), value)
    return out


def paired_medians(records: Iterable[Record], mode: str) -> list[float | None]:
    """Median over reps of each save's ratio to its paired hot-only save (same rep), for
    the ``dcp.save`` wall time, the async stall and the async commit."""
    records = list(records)
    medians: list[float | None] = []
    for kind, field in (("sync", "commit"), ("async", "stall"), ("async", "commit")):
        pair = paired_ratios(
            [r for r in records if r.get("against") == mode and r["kind"] == kind],
            field,
            f"{kind}@{mode}",
            f"{kind}@hot_only/{mode}",
        )
        medians.append(None if pair is None else pair["median"])
    return medians


def migration_states(suite: Mapping[str, Any], mode: str) -> dict[str, int]:
    """How many migrations of each state the mode's migrators recorded (sync and async)."""
    states: dict[str, int] = {}
    for kind in ("sync", "async"):
        for state, count in suite.get("migrations", {}).get(f"{kind}@{mode}", {}).items():
            states[state] = states.get(state, 0) + count
    return dict(sorted(states.items()))


# -- formatting --------------------------------------------------------------------------------


def fmt_value(target: Target) -> str:
    if target.value is None:
        return "n/a"
    return f"{target.value:+.1%}" if target.unit == "%" else f"{target.value:.3f}x"


def fmt_bound(target: Target) -> str:
    bound = f"{target.bound:.0%}" if target.unit == "%" else f"{target.bound:.2f}x"
    return f"{target.op} {bound}"


def verdict(target: Target) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[target.met]


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.0f}"


def ordered(names: Iterable[str], order: Sequence[str]) -> list[str]:
    rank = {n: i for i, n in enumerate(order)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))
