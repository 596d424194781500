"""The generated parts of the save, latency, cpu, migration, load, scaling and gpu suites: their
tables and figures. Each returns "" when the run did not measure it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.infra.measure import GiB, MiB
from benchmarks.infra.stats import by_variant
from benchmarks.report import analysis as A
from benchmarks.report import plots
from benchmarks.report.tables import (
    LOAD_ORDER,
    LOCAL_ORDER,
    SAVE_ORDER,
    failed,
    image,
    joined,
    share,
    size_label,
    spread,
    table,
)

Results = Mapping[str, Any]


def save_part(results: Results, img: Path) -> str:
    """The save stall by size: a table per size, the cases that failed, the figure."""
    out: list[str] = []
    groups: dict[str, dict[str, float]] = {}
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        stall, commit = by_variant(records, "stall"), by_variant(records, "commit")
        cold = by_variant(records, "cold")
        base = A.med(stall, "fsw_sync")
        rows = []
        for name in A.ordered(stall, SAVE_ORDER):
            ratio = A.div(A.med(stall, name), base)
            rows.append(
                [
                    f"`{name}`",
                    spread(stall[name]),
                    f"{ratio:.3f}x" if ratio else "n/a",
                    spread(commit.get(name)),
                    spread(cold.get(name)) if name in cold else "",
                ]
            )
            if ratio and name != "disk_sync":
                groups.setdefault(size_label(size), {})[name] = ratio
        out += [
            f"**{size_label(size)}** (seconds: median (min-max))",
            table(["writer", "stall s", "stall / fsw_sync", "commit s", "cold commit s"], rows),
            failed(records),
        ]
    if groups:
        path = plots.bars(
            img / "save_stall.png",
            "Save stall / FileSystemWriter sync (lower is better)",
            "ratio (log)",
            groups,
            log=True,
            reference=1.0,
        )
        out.append(image(path, "save stall ratios"))
    return joined(*out)


def latency_part(results: Results, img: Path) -> str:
    suite = results["suites"].get("latency")
    if not suite:
        return ""
    stall, commit = A.latency_summary(results), A.latency_summary(results, "commit")
    delays = sorted({ms for series in stall.values() for ms in series})
    rows = []
    for writer in A.ordered(stall, SAVE_ORDER):
        s, c = stall[writer], commit.get(writer, {})
        rows.append(
            [
                f"`{writer}`",
                *[f"{s.get(ms, 0):.2f} ({A.div(s.get(ms), s.get(0)) or 0:.2f}x)" for ms in delays],
                *[f"{c.get(ms, 0):.2f}" for ms in delays],
            ]
        )
    series = {w: {ms: (A.div(v, s[0]) or 0.0) for ms, v in s.items()} for w, s in stall.items() if 0 in s}
    path = plots.lines(
        img / "latency.png",
        "Save stall vs added S3 latency (ratio to +0 ms)",
        "added latency per S3 request (ms)",
        "stall / stall at +0 ms",
        series,
        reference=1.0,
        xticks=delays,
    )
    return joined(
        table(
            ["writer", *[f"stall s @+{ms} ms" for ms in delays], *[f"commit s @+{ms} ms" for ms in delays]],
            rows,
        ),
        failed(suite["records"]),
        image(path, "stall vs latency"),
    )


def hot_part(results: Results, img: Path) -> str:
    """Hot write throughput by size, the disk baseline's share of time in fsync, the figure."""
    out: list[str] = []
    series: dict[str, dict[str, float]] = {}
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        rate, cpu = A.throughput(records, "commit"), A.cpu_per_gib(records)
        base_fsw, base_disk = A.med(rate, "fsw_sync"), A.med(rate, "disk_sync")
        rows = []
        for name in A.ordered(set(rate) & set(LOCAL_ORDER), LOCAL_ORDER):
            value = A.med(rate, name)
            rows.append(
                [
                    f"`{name}`",
                    spread(rate[name], 1 / MiB, "{:.0f}"),
                    f"{A.div(value, base_fsw) or 0:.2f}x",
                    f"{A.div(value, base_disk) or 0:.2f}x",
                    A.seconds(A.med(cpu, name)),
                    f"{A.div(A.med(cpu, name), A.med(cpu, 'fsw_sync')) or 0:.2f}x",
                ]
            )
            series.setdefault(size_label(size), {})[name] = (value or 0) / MiB
        fsync = A.fsync_share(records)
        out += [
            f"**{size_label(size)}**",
            table(["writer", "MiB/s", "vs fsw_sync", "vs disk", "CPU s/GiB", "CPU vs fsw_sync"], rows),
            "" if fsync is None else f"Disk baseline's time in fsync: {share(fsync)}",
        ]
    if series:
        path = plots.bars(
            img / "hot_throughput.png", "Hot write throughput (higher is better)", "MiB/s", series
        )
        out.append(image(path, "hot write throughput"))
    return joined(*out)


CPU_ROWS = {
    "torch_save": "`torch.save` of the tensors to a null sink (zip CRC32 on: the default)",
    "torch_save_nozipcrc": "the same, zip CRC32 off",
    "crc32c": "tierstore's CRC32C of the same bytes",
    "fsw_tmpfs": "`dcp.save`, FileSystemWriter, into tmpfs",
    "tiered_tmpfs": "`dcp.save`, TieredWriter (zip CRC32 off while it writes, F1), into tmpfs",
}


def cpu_part(results: Results, img: Path) -> str:
    """CPU seconds per GiB of the CPU-only measurements."""
    costs = A.cpu_costs(results)
    if not costs:
        return ""
    rows = [
        [text, spread(costs[name], fmt="{:.3f}"), f"{GiB / MiB / costs[name]['median']:.0f}"]
        for name, text in CPU_ROWS.items()
        if name in costs
    ]
    return table(["what", "CPU s/GiB", "MiB per CPU s"], rows)


def migration_part(results: Results, img: Path) -> str:
    suite = results["suites"].get("migration")
    if not suite:
        return ""
    speed = A.migration_rates(results)
    rows = []
    for inflight in sorted({n for kind in speed.values() for n in kind}):
        ours, plain = speed.get("tiered", {}).get(inflight), speed.get("s3fs", {}).get(inflight)
        sweep = [r for r in suite["records"] if r["group"] == "sweep" and r["inflight"] == inflight]
        cpu = A.cpu_per_gib(sweep)
        ratio = A.div(ours["median"] if ours else None, plain["median"] if plain else None)
        rows.append(
            [
                str(inflight),
                spread(ours, fmt="{:.0f}"),
                spread(plain, fmt="{:.0f}"),
                f"{ratio or 0:.2f}x",
                A.seconds(A.med(cpu, "tiered")),
                A.seconds(A.med(cpu, "s3fs")),
            ]
        )
    path = plots.lines(
        img / "migration.png",
        "Migration to S3 (moto): throughput vs parts in flight",
        "parts in flight per file",
        "MiB/s",
        {k: {n: v["median"] for n, v in s.items()} for k, s in speed.items()},
        xticks=sorted({n for s in speed.values() for n in s}),
    )
    return joined(
        table(
            [
                "parts in flight",
                "migrate_pending MiB/s",
                "s3fs put_file MiB/s",
                "ratio",
                "CPU s/GiB migrate_pending",
                "CPU s/GiB s3fs",
            ],
            rows,
        ),
        failed(suite["records"]),
        image(path, "migration throughput"),
    )


def _load_ratio(name: str, t: A.Summaries) -> str:
    """A throughput ratio to the load's baseline; for ``crc_only``, its share of the warm load."""
    base = (
        "fsr_hot_warm"
        if name.endswith("_warm")
        else "fsr_hot"
        if "hot" in name
        else "fsspec_cold"
        if "cold" in name
        else "tiered_hot_warm"
    )
    if name == "crc_only":
        return f"{A.div(t[name]['median'], A.med(t, base)) or 0:.1%} of `{base}`"
    return f"{A.div(A.med(t, base), t[name]['median']) or 0:.2f}x vs `{base}`"


def load_part(results: Results, img: Path) -> str:
    suite = results["suites"].get("load")
    if not suite:
        return ""
    t, cpu = A.load_summary(results), A.cpu_per_gib(suite["records"])
    rows = [
        [
            f"`{name}`",
            spread(t[name]),
            f"{suite['bytes'] / MiB / t[name]['median']:.0f}",
            _load_ratio(name, t),
            A.seconds(A.med(cpu, name)),
        ]
        for name in A.ordered(t, LOAD_ORDER)
    ]
    series = {
        "hot": {n: suite["bytes"] / MiB / t[n]["median"] for n in t if "hot" in n},
        "S3": {n: suite["bytes"] / MiB / t[n]["median"] for n in t if "cold" in n},
    }
    path = plots.bars(img / "load.png", "Load throughput (higher is better)", "MiB/s", series)
    return joined(
        table(["reader", "load s", "MiB/s", "ratio", "CPU s/GiB"], rows),
        failed(suite["records"]),
        image(path, "load throughput"),
    )


def memory_part(results: Results, img: Path) -> str:
    """Peak RSS growth of a rank during a save, by size and writer."""
    rows = []
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        save, total = by_variant(records, "growth_save"), by_variant(records, "growth_total")
        for name in A.ordered(save, SAVE_ORDER):
            if name == "disk_sync":
                continue
            rows.append(
                [
                    size_label(size),
                    f"`{name}`",
                    A.mib(A.med(save, name)),
                    A.mib(A.med(total, name)) if name in total else "",
                ]
            )
    return table(["state", "writer", "save MiB", "save + migration MiB"], rows) if rows else ""


def migration_memory_part(results: Results, img: Path) -> str:
    """Peak RSS growth of the migrating process by checkpoint size (the migration suite)."""
    suite = results["suites"].get("migration")
    if not suite:
        return ""
    memory = A.migration_memory(results)
    sizes = sorted({s for kind in memory.values() for s in kind})
    rows = [
        [size_label(s), A.mib(memory.get("tiered", {}).get(s)), A.mib(memory.get("s3fs", {}).get(s))]
        for s in sizes
    ]
    series = {kind: {s / MiB: v / MiB for s, v in sizes.items()} for kind, sizes in memory.items()}
    figure = ""
    if series:
        path = plots.lines(
            img / "memory.png",
            "Peak RSS growth while migrating vs checkpoint size",
            "checkpoint MiB",
            "MiB",
            series,
        )
        figure = image(path, "migration memory")
    return joined(table(["checkpoint", "migrate_pending", "s3fs put_file"], rows), figure)


def scaling_part(results: Results, img: Path) -> str:
    suite = results["suites"].get("scaling")
    if not suite:
        return ""
    commit, stall = A.scaling_table(results), A.scaling_table(results, "stall")
    rows = []
    for world in sorted(commit):
        c, s = commit[world], stall[world]
        rows.append(
            [
                str(world),
                *[A.seconds(A.med(c, n)) for n in ("disk_sync", "fsw_sync", "tiered_sync")],
                f"{A.div(A.med(c, 'tiered_sync'), A.med(c, 'fsw_sync')) or 0:.2f}x",
                A.seconds(A.med(s, "tiered_async")),
            ]
        )
    bytes_path = plots.lines(
        img / "scaling_bytes.png",
        "Time to commit vs state size (2 ranks)",
        "state MiB",
        "seconds",
        _by_bytes(results),
        log=True,
    )
    ranks = {
        n: {float(w): A.med(commit[w], n) or 0.0 for w in commit}
        for n in ("fsw_sync", "tiered_sync", "disk_sync")
    }
    ranks_path = plots.lines(
        img / "scaling_ranks.png",
        f"Time to commit {size_label(suite['bytes'])} vs ranks",
        "ranks",
        "seconds",
        ranks,
        xticks=sorted(commit),
    )
    return joined(
        table(
            ["ranks", "disk s", "fsw_sync s", "tiered_sync s", "tiered / fsw", "tiered_async stall s"], rows
        ),
        image(bytes_path, "time vs bytes"),
        image(ranks_path, "time vs ranks"),
    )


def _by_bytes(results: Results) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for size in A.save_sizes(results):
        commit = by_variant(A.save_records(results, size), "commit")
        for name in ("disk_sync", "fsw_sync", "tiered_sync", "fsspec_sync"):
            if name in commit:
                out.setdefault(name, {})[size / MiB] = commit[name]["median"]
    return out


def gpu_part(results: Results, img: Path) -> str:
    """The GPU stagers' stall, or why the run skipped them."""
    gpu = results["suites"].get("gpu")
    if not gpu:
        return ""
    if gpu.get("skipped"):
        return f"**Skipped in this run**: {gpu['reason']}."
    stall, staged = by_variant(gpu["records"], "stall"), by_variant(gpu["records"], "staged")
    rows = [[f"`{n}`", spread(stall[n], fmt="{:.3f}"), spread(staged.get(n), fmt="{:.3f}")] for n in stall]
    return joined(
        f"{gpu['device']}, {size_label(gpu['bytes'])}:", table(["stager", "stall s", "staged s"], rows)
    )
