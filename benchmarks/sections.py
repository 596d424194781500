"""The report's sections for items 1 to 8, each with its tables and figure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks import analysis as A
from benchmarks import plots
from benchmarks.markdown import (
    IMG,
    LOAD_ORDER,
    LOCAL_ORDER,
    SAVE_ORDER,
    Lines,
    image,
    size_label,
    spread,
    table,
)
from benchmarks.measure import GiB, MiB, by_variant


def save_section(results: Mapping[str, Any]) -> Lines:
    out = ["## 1. Save stall", "",
           "Time the training thread is blocked by one save of a state of float32 DTensors "
           "sharded over 2 ranks (16 MiB tensors per rank). `_sync` is `dcp.save`; `_async` is "
           "`dcp.async_save` (thread mode) with the same stager for every writer: DCP's default "
           "blocking copy into CPU buffers that are reused from save to save (pinned memory "
           "needs an accelerator). `commit` is the time until the checkpoint is complete "
           "(the async future resolved); `cold` is tierstore's time until the cold manifest is "
           "published in S3. The checkpoint collectives run on their own gloo group. Ratio = "
           "stall / FileSystemWriter sync stall.", ""]
    groups: dict[str, dict[str, float]] = {}
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        stall, commit = by_variant(records, "stall"), by_variant(records, "commit")
        cold = by_variant(records, "cold")
        base = A.med(stall, "fsw_sync")
        rows = []
        for name in A.ordered(stall, SAVE_ORDER):
            ratio = A.div(A.med(stall, name), base)
            rows.append([f"`{name}`", spread(stall[name]), f"{ratio:.3f}x" if ratio else "n/a",
                         spread(commit.get(name)), spread(cold.get(name)) if name in cold else ""])
            if ratio and name != "disk_sync":
                groups.setdefault(size_label(size), {})[name] = ratio
        out += [f"**{size_label(size)}** (seconds: median (min-max))", "",
                *table(["writer", "stall s", "stall / fsw_sync", "commit s", "cold commit s"], rows)]
        out += _errors(records)
    skipped = [s for s in A.save_sizes(results) if s in results["profile"]["hot_only_sizes"]]
    if skipped:
        out += [f"At {', '.join(size_label(s) for s in skipped)} this profile runs the local "
                "writers only: moto needs minutes per GiB and keeps every object in memory (S3 "
                "writers at 4 GiB ran its server out of memory on a 23.5 GiB machine); "
                "`tiered_async` there has no cold tier. `make bench-full` runs every writer at "
                "256 MiB and 1 GiB, the local ones at 4 GiB too.", ""]
    if groups:
        path = plots.bars(IMG / "save_stall.png", "Save stall / FileSystemWriter sync (lower is better)",
                          "ratio (log)", groups, log=True, reference=1.0)
        out.append(image(path, "save stall ratios"))
    return out


def _errors(records: list[dict[str, Any]]) -> Lines:
    found = A.errors(records)
    return [f"- `{name}` failed: {error[:300]}" for name, error in found.items()] + ([""] if found else [])


def latency_section(results: Mapping[str, Any]) -> Lines:
    suite = results["suites"].get("latency")
    if not suite:
        return []
    stall, commit = A.latency_summary(results), A.latency_summary(results, "commit")
    delays = sorted({ms for series in stall.values() for ms in series})
    rows = []
    for writer in A.ordered(stall, SAVE_ORDER):
        s, c = stall[writer], commit.get(writer, {})
        rows.append([f"`{writer}`", *[f"{s.get(ms, 0):.2f} ({A.div(s.get(ms), s.get(0)) or 0:.2f}x)"
                                      for ms in delays],
                     *[f"{c.get(ms, 0):.2f}" for ms in delays]])
    series = {w: {ms: (A.div(v, s[0]) or 0.0) for ms, v in s.items()} for w, s in stall.items() if 0 in s}
    path = plots.lines(IMG / "latency.png", "Save stall vs added S3 latency (ratio to +0 ms)",
                       "added latency per S3 request (ms)", "stall / stall at +0 ms", series,
                       reference=1.0, xticks=delays)
    return ["## 2. Stall vs cold-tier latency", "",
            f"The same 2-rank saves of {size_label(suite['bytes'])}, every S3 request sent through "
            "a proxy (its own process) that waits the given time before forwarding it to moto. "
            "Stall in seconds, with its ratio to the same writer's stall at +0 ms; then the time to "
            "commit. tierstore's stall never waits on S3 (the save commits on the hot tier, the "
            "migrator uploads in the background); a sync save straight to S3 waits for every "
            "request. An async save straight to S3 also keeps a flat stall, but its commit grows "
            "with the latency: once the time between checkpoints is shorter than that, the next "
            "save waits for the previous one and the stall comes back.", "",
            *table(["writer", *[f"stall s @+{ms} ms" for ms in delays],
                    *[f"commit s @+{ms} ms" for ms in delays]], rows),
            *_errors(suite["records"]), image(path, "stall vs latency")]


def hot_section(results: Mapping[str, Any]) -> Lines:
    out = ["## 3. Hot write throughput", "",
           "Bytes / time to commit of a sync save (`dcp.save`), 2 ranks on the local disk. "
           "Baselines in the same job, interleaved: DCP's `FileSystemWriter` (fsyncs each file) and "
           "the disk itself: each rank writes the same tensor bytes to one file with `os.write` "
           "then fsyncs file and directory (fio is not installed here). MiB/s: median "
           "(min-max).", ""]
    series: dict[str, dict[str, float]] = {}
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        rate, cpu = A.throughput(records, "commit"), A.cpu_per_gib(records)
        base_fsw, base_disk = A.med(rate, "fsw_sync"), A.med(rate, "disk_sync")
        rows = []
        for name in A.ordered(set(rate) & set(LOCAL_ORDER), LOCAL_ORDER):
            value = A.med(rate, name)
            rows.append([f"`{name}`", spread(rate[name], 1 / MiB, "{:.0f}"),
                         f"{A.div(value, base_fsw) or 0:.2f}x", f"{A.div(value, base_disk) or 0:.2f}x",
                         A.seconds(A.med(cpu, name)),
                         f"{A.div(A.med(cpu, name), A.med(cpu, 'fsw_sync')) or 0:.2f}x"])
            series.setdefault(size_label(size), {})[name] = (value or 0) / MiB
        out += [f"**{size_label(size)}**", "",
                *table(["writer", "MiB/s", "vs fsw_sync", "vs disk", "CPU s/GiB", "CPU vs fsw_sync"],
                       rows), *_fsync_share(records)]
    if series:
        path = plots.bars(IMG / "hot_throughput.png", "Hot write throughput (higher is better)",
                          "MiB/s", series)
        out.append(image(path, "hot write throughput"))
    return out + _cpu_costs(results)


CPU_ROWS = {"torch_save": "`torch.save` of the tensors to a null sink (zip CRC32 on: the default)",
            "torch_save_nozipcrc": "the same, zip CRC32 off",
            "crc32c": "tierstore's CRC32C of the same bytes",
            "fsw_tmpfs": "`dcp.save`, FileSystemWriter, into tmpfs",
            "tiered_tmpfs": "`dcp.save`, TieredWriter (zip CRC32 off while it writes, F1), "
                            "into tmpfs"}


def _cpu_costs(results: Mapping[str, Any]) -> Lines:
    costs = A.cpu_costs(results)
    if not costs:
        return []
    suite = results["suites"]["cpu"]
    rows = [[text, spread(costs[name], fmt="{:.3f}"), f"{GiB / MiB / costs[name]['median']:.0f}"]
            for name, text in CPU_ROWS.items() if name in costs]
    return [f"**CPU only** (one process, {size_label(suite['bytes'])} in 16 MiB tensors, no "
            "disk: the sinks are a null file object and tmpfs), timed in CPU seconds of the "
            "process, which contention on a shared VM barely moves. CPU seconds per GiB: median "
            "(min-max).", "", *table(["what", "CPU s/GiB", "MiB per CPU s"], rows)]


def _fsync_share(records: list[dict[str, Any]]) -> Lines:
    """How much of the disk baseline's time its fsyncs took: near 0, the page cache absorbed
    the writes and the baseline runs at memory speed."""
    disk = [r for r in records if r["variant"] == "disk_sync" and r.get("fsync") and r.get("commit")]
    if not disk:
        return []
    shares = sorted(r["fsync"] / r["commit"] for r in disk)
    return [f"The disk baseline spent {shares[len(shares) // 2]:.0%} (median; "
            f"{shares[0]:.0%}-{shares[-1]:.0%}) of its time in fsync; the rest is copying into "
            "the page cache.", ""]


def migration_section(results: Mapping[str, Any]) -> Lines:
    suite = results["suites"].get("migration")
    if not suite:
        return []
    speed = A.migration_rates(results)
    memory = A.migration_memory(results)
    rows = []
    for inflight in sorted({n for kind in speed.values() for n in kind}):
        ours, plain = speed.get("tiered", {}).get(inflight), speed.get("s3fs", {}).get(inflight)
        sweep = [r for r in suite["records"] if r["group"] == "sweep" and r["inflight"] == inflight]
        cpu = A.cpu_per_gib(sweep)
        rows.append([str(inflight), spread(ours, fmt="{:.0f}"), spread(plain, fmt="{:.0f}"),
                     f"{A.div(ours and ours['median'], plain and plain['median']) or 0:.2f}x",
                     A.seconds(A.med(cpu, "tiered")), A.seconds(A.med(cpu, "s3fs"))])
    sizes = sorted({s for kind in memory.values() for s in kind})
    mem_rows = [[size_label(s), A.mib(memory.get("tiered", {}).get(s)),
                 A.mib(memory.get("s3fs", {}).get(s))] for s in sizes]
    largest = max((r["bytes"] for r in suite["records"] if r["group"] == "sweep"), default=0)
    path = plots.lines(IMG / "migration.png", "Migration to S3 (moto): throughput vs parts in flight",
                       "parts in flight per file", "MiB/s",
                       {k: {n: v["median"] for n, v in s.items()} for k, s in speed.items()},
                       xticks=sorted({n for s in speed.values() for n in s}))
    return ["## 4. Migration throughput", "",
            f"`migrate_pending` of a committed {size_label(largest)} checkpoint (2 ranks' files) from "
            "the hot tier to S3, against plain `s3fs` `put_file` of the very same files to the "
            f"same server, one file after the other, both with {suite['part_size'] // MiB} MiB "
            "parts and the same number of parts in flight per file, each from a new client. "
            "tierstore's time includes what makes the copy trustworthy: reading the source back "
            "against its manifest CRC32C, a CRC32C per part checked by S3, the stored object's "
            "size and checksum, the upload marks and the cold manifest. MiB/s: median (min-max).", "",
            *table(["parts in flight", "migrate_pending MiB/s", "s3fs put_file MiB/s", "ratio",
                    "CPU s/GiB migrate_pending", "CPU s/GiB s3fs"], rows),
            *_errors(suite["records"]), image(path, "migration throughput"),
            f"Peak RSS growth (MiB) of the migrating process, {suite['default_inflight']} parts in "
            "flight, by checkpoint size (the flat-memory check of item 6). The pipeline holds "
            "at most parts in flight x part size per file "
            f"({suite['default_inflight']} x {suite['part_size'] // MiB} MiB here), for the 2 "
            "files the migrator copies at once by default (`MigrationConfig.concurrency`); small rank "
            "files (a 128 MiB checkpoint over 2 ranks has 64 MiB files, 4 parts each) keep it "
            "full only briefly, so their peak is lower, and from there on the growth stays "
            "flat: the flat check compares the two largest sizes. The growth also counts the "
            "S3 client's own buffers and connection pools, which is why it sits above the "
            "pipeline's bytes; plain s3fs `put_file` of the same files grows about as much.", "",
            *table(["checkpoint", "migrate_pending", "s3fs put_file"], mem_rows)]


def load_section(results: Mapping[str, Any]) -> Lines:
    suite = results["suites"].get("load")
    if not suite:
        return []
    t, cpu = A.load_summary(results), A.cpu_per_gib(suite["records"])
    rows = []
    for name in A.ordered(t, LOAD_ORDER):
        base = ("fsr_hot_warm" if name.endswith("_warm") else "fsr_hot" if "hot" in name
                else "fsspec_cold" if "cold" in name else "tiered_hot_warm")
        ratio = (f"{A.div(t[name]['median'], A.med(t, base)) or 0:.1%} of `{base}`"
                 if name == "crc_only" else
                 f"{A.div(A.med(t, base), t[name]['median']) or 0:.2f}x vs `{base}`")
        rows.append([f"`{name}`", spread(t[name]), f"{suite['bytes'] / MiB / t[name]['median']:.0f}",
                     ratio, A.seconds(A.med(cpu, name))])
    series = {"hot": {n: suite["bytes"] / MiB / t[n]["median"] for n in t if "hot" in n},
              "S3": {n: suite["bytes"] / MiB / t[n]["median"] for n in t if "cold" in n}}
    path = plots.bars(IMG / "load.png", "Load throughput (higher is better)", "MiB/s", series)
    return ["## 5. Load", "",
            f"`dcp.load` of a {size_label(suite['bytes'])} checkpoint into 2 ranks, the page cache "
            "dropped before each load (as on a resume after a restart), except for `_warm` "
            "loads, timed right after an untimed load of the same files (as on a resume on the "
            "node that just saved; CPU-bound, the worst case for verification). Hot: "
            "`TieredReader` (hot tier only) vs DCP `FileSystemReader` of the same state saved by "
            "`FileSystemWriter`. Cold only: `TieredReader` with only the S3 tier vs DCP "
            "`FsspecReader` (and s3torchconnector's `S3StorageReader`). `_nocrc` is a benchmark-only "
            "`TieredReader` with the CRC32C left out (sizes still checked); `crc_only` is the time "
            "to CRC32C the rank's file bytes already in memory. Seconds: median (min-max); the "
            "ratio is a throughput ratio (above 1: faster than the baseline).", "",
            *table(["reader", "load s", "MiB/s", "ratio", "CPU s/GiB"], rows),
            *_errors(suite["records"]),
            image(path, "load throughput")]


def memory_section(results: Mapping[str, Any]) -> Lines:
    rows = []
    for size in A.save_sizes(results):
        records = A.save_records(results, size)
        save, total = by_variant(records, "growth_save"), by_variant(records, "growth_total")
        for name in A.ordered(save, SAVE_ORDER):
            if name == "disk_sync":
                continue
            rows.append([size_label(size), f"`{name}`", A.mib(A.med(save, name)),
                         A.mib(A.med(total, name)) if name in total else ""])
    memory = A.migration_memory(results)
    series = {kind: {s / MiB: v / MiB for s, v in sizes.items()} for kind, sizes in memory.items()}
    out = ["## 6. Memory", "",
           "Peak RSS growth of a rank during a save (the slowest rank; `/proc/self/clear_refs` "
           "then `VmHWM`), staging buffers already allocated as in a long run; for tierstore with "
           "a cold tier also until its migration finished. The migration side is in item 4's "
           "table.", "", *table(["state", "writer", "save MiB", "save + migration MiB"], rows)]
    if series:
        path = plots.lines(IMG / "memory.png", "Peak RSS growth while migrating vs checkpoint size",
                           "checkpoint MiB", "MiB", series)
        out.append(image(path, "migration memory"))
    return out


def scaling_section(results: Mapping[str, Any]) -> Lines:
    suite = results["suites"].get("scaling")
    if not suite:
        return []
    commit, stall = A.scaling_table(results), A.scaling_table(results, "stall")
    rows = []
    for world in sorted(commit):
        c, s = commit[world], stall[world]
        rows.append([str(world), *[A.seconds(A.med(c, n)) for n in ("disk_sync", "fsw_sync", "tiered_sync")],
                     f"{A.div(A.med(c, 'tiered_sync'), A.med(c, 'fsw_sync')) or 0:.2f}x",
                     A.seconds(A.med(s, "tiered_async"))])
    by_bytes = _by_bytes(results)
    bytes_path = plots.lines(IMG / "scaling_bytes.png", "Time to commit vs state size (2 ranks)",
                             "state MiB", "seconds", by_bytes, log=True)
    ranks = {n: {float(w): A.med(commit[w], n) or 0.0 for w in commit}
             for n in ("fsw_sync", "tiered_sync", "disk_sync")}
    ranks_path = plots.lines(IMG / "scaling_ranks.png",
                             f"Time to commit {size_label(suite['bytes'])} vs ranks", "ranks",
                             "seconds", ranks, xticks=sorted(commit))
    return ["## 7. Scaling", "",
            f"The same {size_label(suite['bytes'])} saved by 1, 2 and 4 ranks (4 ranks on 2 cores "
            "oversubscribe them), local tiers only; time to commit in seconds (medians), then the "
            "async stall. Time vs bytes comes from item 1.", "",
            *table(["ranks", "disk s", "fsw_sync s", "tiered_sync s", "tiered / fsw",
                    "tiered_async stall s"], rows),
            image(bytes_path, "time vs bytes"), image(ranks_path, "time vs ranks")]


def _by_bytes(results: Mapping[str, Any]) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for size in A.save_sizes(results):
        commit = by_variant(A.save_records(results, size), "commit")
        for name in ("disk_sync", "fsw_sync", "tiered_sync", "fsspec_sync"):
            if name in commit:
                out.setdefault(name, {})[size / MiB] = commit[name]["median"]
    return out


def gpu_section(results: Mapping[str, Any]) -> Lines:
    gpu = results["suites"].get("gpu")
    out = ["## 8. GPU staging", "",
           "`benchmarks/gpu.py`: a state on the GPU saved with `async_save` + `TieredWriter`, "
           "DCP's default stager for async_save (blocking copy to pageable memory) against "
           "`DefaultStager(StagingOptions(use_pinned_memory=True, ...))`, blocking and with "
           "asynchronous staging on a side stream. It runs wherever CUDA is present.", ""]
    if not gpu or gpu.get("skipped"):
        reason = gpu["reason"] if gpu else "not run"
        return [*out, f"**Skipped in this run**: {reason}.", ""]
    stall, staged = by_variant(gpu["records"], "stall"), by_variant(gpu["records"], "staged")
    rows = [[f"`{n}`", spread(stall[n], fmt="{:.3f}"), spread(staged.get(n), fmt="{:.3f}")]
            for n in stall]
    return [*out, f"{gpu['device']}, {size_label(gpu['bytes'])}:", "",
            *table(["stager", "stall s", "staged s"], rows)]
