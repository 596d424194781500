"""The ``save`` and ``prepare`` operations of a rank (see rank_job.py)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.infra.measure import (
    MiB,
    Record,
    cpu_seconds,
    now,
    peak_growth,
    reset_peak_rss,
)
from benchmarks.jobs import writers
from benchmarks.jobs.rank_context import (
    Context,
    cleanup,
    local_bytes,
    local_views,
    make_state,
    where,
)
from benchmarks.profiles import checkpoint_name


def save_once(
    ctx: Context, variant: str, state: dict[str, Any], place: writers.Where, stager: DefaultStager
) -> Record:
    """Save ``state`` once with ``variant``; time it (and its migration) on this rank."""
    rss = reset_peak_rss()
    cpu = cpu_seconds()
    start = now()
    writer = None
    extra: Record = {}
    if variant.startswith("disk"):
        path = os.path.join(place.local, f"rank{ctx.rank}.bin")
        extra["fsync"] = writers.write_raw(local_views(state), path)
        stall = commit = now() - start
    elif writers.is_async(variant):
        writer = writers.make_writer(variant, place)
        future = dcp.async_save(state, storage_writer=writer, process_group=ctx.group, async_stager=stager)
        stall = now() - start
        # A blocking stager: a plain Future, not an AsyncSaveResponse.
        assert isinstance(future, Future), type(future)
        future.result()
        commit = now() - start
    else:
        writer = writers.make_writer(variant, place)
        dcp.save(state, storage_writer=writer, process_group=ctx.group)
        stall = commit = now() - start
    record: Record = {
        "stall": stall,
        "commit": commit,
        "growth_save": peak_growth(rss),
        "cpu": cpu_seconds() - cpu,
        **extra,
    }
    migrator = getattr(writer, "migrator", None)
    if migrator is not None:
        record.update(_wait_migration(migrator, start))
        record["growth_total"] = peak_growth(rss)
        record["cpu_total"] = cpu_seconds() - cpu
    return record


def _wait_migration(migrator: Any, start: float) -> Record:
    migrator.wait(1800)
    cold = now() - start
    failures = migrator.failures()
    migrator.close()
    migrator.cold.backend.close()
    if failures:
        return {"cold": cold, "error": f"migration failed: {failures[0].error}"}
    return {"cold": cold}


def measure_save(
    ctx: Context, case: dict[str, str], state: dict[str, Any], rep: int, stager: DefaultStager
) -> Record:
    label = case["label"]
    place = where(ctx, f"{label}-rep{rep}", case.get("endpoint", "direct"))
    record: Record = {"variant": label, "rep": rep, "rank": ctx.rank, "bytes": local_bytes(state)}
    dist.barrier()
    try:
        record.update(save_once(ctx, case["variant"], state, place, stager))
    except (Exception, CheckpointException) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:2000]
        ctx.broken.setdefault(label, record["error"])
    cleanup(ctx, place)
    return record


def rotated(items: list[dict[str, str]], rep: int) -> list[dict[str, str]]:
    """The cases in a different order each rep, so drift does not favour one."""
    shift = rep % len(items)
    return items[shift:] + items[:shift]


def warm_up(ctx: Context, cases: list[dict[str, str]], stager: DefaultStager) -> None:
    """A tiny save per case: imports, clients and connection pools are ready before timing."""
    tiny = make_state(ctx, 2 * MiB * ctx.world, seed=99)
    for case in cases:
        record = measure_save(ctx, case, tiny, -1, stager)
        if record.get("error"):
            ctx.say(f"    {case['label']}: fails in warm-up, skipped: {record['error'][:300]}")


def run_saves(ctx: Context) -> list[Record]:
    spec = ctx.spec
    cases = list(spec["cases"])
    state = make_state(ctx, spec["bytes"])
    # One stager for every async case: blocking copy into cached, reused CPU buffers
    # (DCP's default for async_save, minus pinned memory, which needs an accelerator).
    stager = DefaultStager(StagingOptions(False, False, False, False))
    warm_up(ctx, cases, stager)
    stager.stage(state)  # allocate the staging buffers once, as a long training run has
    records = []
    reps = max(spec["reps"], spec.get("local_reps", 0))
    for rep in range(reps):
        for case in rotated(_due(ctx, cases, rep), rep):
            record = measure_save(ctx, case, state, rep, stager)
            records.append(record)
            _progress(ctx, record, reps)
    stager.close()
    return records


def _due(ctx: Context, cases: list[dict[str, str]], rep: int) -> list[dict[str, str]]:
    """Cases still to run at ``rep``: S3 ones for ``reps``, local ones for ``local_reps``."""
    has_s3 = ctx.direct is not None
    limit = {True: ctx.spec["reps"], False: ctx.spec.get("local_reps", ctx.spec["reps"])}
    return [
        c
        for c in cases
        if c["label"] not in ctx.broken and rep < limit[writers.uses_s3(c["variant"], has_s3)]
    ]


def _progress(ctx: Context, record: Record, reps: int) -> None:
    if record.get("error"):
        ctx.say(f"    rep {record['rep'] + 1}/{reps} {record['variant']:<24} ERROR {record['error'][:200]}")
        return
    cold = f"  cold {record['cold']:6.2f}s" if record.get("cold") is not None else ""
    ctx.say(
        f"    rep {record['rep'] + 1}/{reps} {record['variant']:<24} stall "
        f"{record['stall']:6.2f}s  commit {record['commit']:6.2f}s{cold}"
    )


def run_prepare(ctx: Context) -> list[Record]:
    """Hot-only tierstore checkpoints named ``size-<MiB>`` in one store, for migration."""
    from tierstore import TieredWriter

    records = []
    for size in ctx.spec["sizes"]:
        state = make_state(ctx, size, seed=size // MiB)
        name = checkpoint_name(size)
        dcp.save(state, storage_writer=TieredWriter(ctx.spec["hot"], name=name), process_group=ctx.group)
        records.append({"variant": name, "rank": ctx.rank, "bytes": local_bytes(state)})
        del state
    return records
