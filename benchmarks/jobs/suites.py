"""The benchmark suites: what each one measures, and the jobs it runs for that.

A suite runs in the driver process (``python -m benchmarks``); its measurements run in
processes of their own: multi-rank jobs (``rank_job``, through ``Bench.ranks``) and
one-process job modules (``Bench.module``), against the servers the driver started.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.infra.launch import run_module, run_ranks
from benchmarks.infra.measure import MiB, Record
from benchmarks.infra.servers import S3Target, ServerProcess, create_bucket, reset_moto, start_proxy
from benchmarks.infra.stats import merge_ranks
from benchmarks.profiles import Profile, checkpoint_name

MAX_FIELDS = ("stall", "commit", "cold", "growth_save", "growth_total", "load", "fsync")
SUM_FIELDS = ("bytes", "cpu", "cpu_total")


@dataclass
class Bench:
    profile: Profile
    scratch: Path
    moto: ServerProcess
    target: S3Target
    s3torch: dict[str, Any] = field(default_factory=dict)
    jobs: int = 0

    def fresh_bucket(self) -> None:
        """Empty moto between suites (it keeps objects in memory and temp files)."""
        reset_moto(self.moto.url)
        self.target = create_bucket(self.moto.url, self.target.bucket)

    def ranks(self, op: str, world: int, **spec: Any) -> list[Record]:
        """Run one multi-rank job; return its records merged over ranks (slowest wins)."""
        self.jobs += 1
        job = f"{op}{self.jobs}"
        spec = {
            "op": op,
            "job": job,
            "scratch": str(self.scratch / job),
            "reps": self.profile.reps,
            "s3": {"direct": self.target.to_json()},
            **spec,
        }
        try:
            per_rank = run_ranks(spec, world, self.scratch / f"{job}-out")
        finally:
            shutil.rmtree(self.scratch / job, ignore_errors=True)
        flat = [r for records in per_rank for r in records]
        merged = merge_ranks(flat, ("variant", "rep"), MAX_FIELDS, SUM_FIELDS)
        for record in merged:
            record["world"] = world
        return merged

    def module(self, name: str, spec: dict[str, Any], timeout: float = 3600) -> Any:
        """Run ``python -m benchmarks.jobs.<name> SPEC OUT`` in its own process; return OUT."""
        return run_module(name, spec, self.scratch / f"{name}-{uuid.uuid4().hex[:6]}", timeout)


# -- suites --------------------------------------------------------------------------------

SAVE_VARIANTS = (
    "disk_sync",
    "fsw_sync",
    "fsw_async",
    "tiered_sync",
    "tiered_async",
    "fsspec_sync",
    "fsspec_async",
    "s3torch_sync",
    "s3torch_async",
)
LOCAL_VARIANTS = ("disk_sync", "fsw_sync", "fsw_async", "tiered_sync", "tiered_async")
LOAD_VARIANTS = (
    "fsr_hot",
    "tiered_hot",
    "fsr_hot_warm",
    "tiered_hot_warm",
    "tiered_hot_nocrc_warm",
    "fsspec_cold",
    "tiered_cold",
    "s3torch_cold",
)


def _available(bench: Bench, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not n.startswith("s3torch") or bench.s3torch.get("available")]


def suite_save(bench: Bench) -> dict[str, Any]:
    """Save stall, hot write throughput, save memory and time vs bytes: 2 ranks, every writer."""
    out: dict[str, Any] = {}
    for size in (*bench.profile.save_sizes, *bench.profile.hot_only_sizes):
        with_s3 = size in bench.profile.save_sizes
        variants = [
            v
            for v in _available(bench, SAVE_VARIANTS if with_s3 else LOCAL_VARIANTS)
            if v not in bench.profile.save_skip_variants
        ]
        print(f"  save, 2 ranks, {size // MiB} MiB: {', '.join(variants)}", flush=True)
        cases = [{"label": v, "variant": v} for v in variants]
        reps = (
            {"local_reps": bench.profile.local_reps}
            if with_s3
            else {"s3": {}, "reps": bench.profile.hot_only_reps, "local_reps": bench.profile.hot_only_reps}
        )
        out[str(size)] = bench.ranks("save", 2, bytes=size, cases=cases, **reps)
        bench.fresh_bucket()
    return out


def suite_latency(bench: Bench) -> dict[str, Any]:
    """Stall vs cold-tier latency: the same saves through proxies adding 0 / 50 / 200 ms to
    every S3 request."""
    proxies = {ms: start_proxy(bench.moto.url, ms / 1000) for ms in bench.profile.latency_ms}
    try:
        s3 = {"direct": bench.target.to_json()}
        s3.update(
            {f"{ms}ms": {"endpoint": p.url, "bucket": bench.target.bucket} for ms, p in proxies.items()}
        )
        cases = [
            {"label": f"{v}@{ms}ms", "variant": v, "endpoint": f"{ms}ms"}
            for ms in bench.profile.latency_ms
            for v in _available(bench, bench.profile.latency_variants)
        ]
        size = bench.profile.latency_size
        print(
            f"  latency, 2 ranks, {size // MiB} MiB, +{bench.profile.latency_ms} ms per request", flush=True
        )
        records = bench.ranks("save", 2, bytes=size, cases=cases, s3=s3)
    finally:
        for proxy in proxies.values():
            proxy.stop()
    bench.fresh_bucket()
    return {"bytes": size, "records": records}


def suite_migration(bench: Bench) -> dict[str, Any]:
    """Migration throughput and memory: migrate_pending vs s3fs put_file, same files."""
    profile = bench.profile
    hot = bench.scratch / "migration-hot"
    sizes = sorted({profile.migration_sweep_size, *profile.migration_memory_sizes})
    print(f"  migration: writing hot checkpoints of {[s // MiB for s in sizes]} MiB", flush=True)
    bench.ranks("prepare", 2, sizes=sizes, hot=str(hot))
    spec = {
        "hot": str(hot),
        "sweep_name": checkpoint_name(profile.migration_sweep_size),
        "memory_names": [checkpoint_name(s) for s in profile.migration_memory_sizes],
        "target": bench.target.to_json(),
        "sweep": list(profile.migration_sweep),
        "reps": profile.reps,
        "memory_reps": profile.migration_memory_reps,
        "part_size": profile.part_size,
        "chunk_size": 8 * MiB,
        "default_inflight": profile.default_inflight,
    }
    try:
        records = bench.module("migrate_job", spec)
    finally:
        shutil.rmtree(hot, ignore_errors=True)
    bench.fresh_bucket()
    return {"records": records, "part_size": profile.part_size, "default_inflight": profile.default_inflight}


def suite_load(bench: Bench) -> dict[str, Any]:
    """Loads from the hot tier and from S3 alone, with and without CRC32C."""
    size = bench.profile.load_size
    variants = _available(bench, LOAD_VARIANTS)
    print(f"  load, 2 ranks, {size // MiB} MiB: {', '.join(variants)}", flush=True)
    records = bench.ranks("load", 2, bytes=size, cases=variants, drop_caches=True)
    bench.fresh_bucket()
    return {"bytes": size, "records": records}


def suite_scaling(bench: Bench) -> dict[str, Any]:
    """Scaling: the same total bytes saved by 1, 2 and 4 ranks (local tiers)."""
    size = bench.profile.scaling_size
    out: dict[str, Any] = {"bytes": size, "by_ranks": {}}
    cases = [{"label": v, "variant": v} for v in ("disk_sync", "fsw_sync", "tiered_sync", "tiered_async")]
    for world in bench.profile.scaling_ranks:
        print(f"  scaling: {size // MiB} MiB on {world} rank(s)", flush=True)
        out["by_ranks"][str(world)] = bench.ranks(
            "save", world, bytes=size, cases=cases, s3={}, reps=bench.profile.scaling_reps
        )
    return out


def suite_cpu(bench: Bench) -> dict[str, Any]:
    """The CPU side of hot write throughput: the pieces of a save per GiB, and saves into tmpfs."""
    size = bench.profile.cpu_size
    print(f"  cpu: torch.save, CRC32C and dcp.save into tmpfs, {size // MiB} MiB, one process", flush=True)
    return dict(bench.module("cpu_costs", {"bytes": size, "reps": bench.profile.hot_only_reps + 2}))


def suite_gpu(bench: Bench) -> dict[str, Any]:
    """GPU staging: pinned-memory staging vs DCP's default stager; skipped without CUDA."""
    result = bench.module(
        "gpu", {"bytes": bench.profile.gpu_size, "reps": bench.profile.reps, "scratch": str(bench.scratch)}
    )
    if result.get("skipped"):
        print(f"  gpu: skipped ({result['reason']})", flush=True)
    return dict(result)


def suite_cold_down(bench: Bench) -> dict[str, Any]:
    """Saves with the S3 cold tier healthy, refusing, stalled, denying writes."""
    size = bench.profile.cold_down_size
    print(
        f"  cold-down: {size // MiB} MiB, one process, cold tier healthy / refusing / "
        "stalled / denying writes vs hot only",
        flush=True,
    )
    spec = {
        "bytes": size,
        "reps": bench.profile.cold_down_reps,
        "endpoint": bench.moto.url,
        "bucket": bench.target.bucket,
        "scratch": str(bench.scratch / "cold-down"),
    }
    result = dict(bench.module("cold_down", spec))
    bench.fresh_bucket()
    return result


def suite_perf(bench: Bench) -> dict[str, Any]:
    """Issue 14's targets: save and load CPU and throughput against DCP's writer and reader
    and the disk, the CRC32C share, CheckpointManager's stall against a sync save and the
    peers (DCP async_save, torch_checkpointing). One process per job, local tiers only."""
    profile = bench.profile
    print(
        f"  perf: {profile.perf_size // MiB} MiB model + optimizer state, one process, "
        f"best of {profile.perf_reps}",
        flush=True,
    )
    scratch = str(bench.scratch / "perf")
    io = bench.module("perf_io", {"bytes": profile.perf_size, "reps": profile.perf_reps, "scratch": scratch})
    # One process per system: their CPU is counted over the process tree, and a system's
    # background threads or helper processes must not run inside another's window.
    stall: dict[str, Any] = {}
    for system in STALL_SYSTEMS:
        part = bench.module(
            "perf_stall",
            {"bytes": profile.perf_size, "saves": profile.perf_saves, "scratch": scratch, "only": [system]},
        )
        stall = {**part, "records": [*stall.get("records", []), *part["records"]]} if stall else part
    print(f"  perf: the training-shaped loop, {profile.perf_loop_reps} reps on tmpfs", flush=True)
    loop = bench.module("perf_loop", {"bytes": profile.perf_size, "reps": profile.perf_loop_reps})
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "io": io,
        "stall": stall,
        "loop": {"bytes": profile.perf_size, "reps": profile.perf_loop_reps, "records": loop},
    }


def suite_preemption(bench: Bench) -> dict[str, Any]:
    """The save on a preemption notice against a plain sync save of the same state,
    with a local and an S3 cold tier; the share of the grace period the push leaves. Then
    from the signal to the exit of a 2-rank job, per training loop (preemption_exit)."""
    profile = bench.profile
    print(
        f"  preemption: {profile.preemption_size // MiB} MiB, one process, best of "
        f"{profile.preemption_reps}, cold tier local / S3",
        flush=True,
    )
    colds = [
        {"kind": "local", "url": str(bench.scratch / "preemption-cold")},
        {"kind": "s3", "url": bench.target.url("preemption"), "options": bench.target.tier_options()},
    ]
    spec = {
        "bytes": profile.preemption_size,
        "reps": profile.preemption_reps,
        "grace": profile.preemption_grace,
        "colds": colds,
        "scratch": str(bench.scratch / "preemption"),
    }
    result = dict(bench.module("preemption", spec))
    bench.fresh_bucket()
    print(
        f"  preemption: signal to exit, 2 ranks, {profile.preemption_exit_size // MiB} MiB, best of "
        f"{profile.preemption_exit_reps}: the README's loop, the preempted loop, Lightning, torchtitan",
        flush=True,
    )
    exits = {
        "bytes": profile.preemption_exit_size,
        "reps": profile.preemption_exit_reps,
        "grace": profile.preemption_grace,
        "scratch": str(bench.scratch / "preemption-exit"),
    }
    result["exit"] = bench.module("preemption_exit", exits)
    return result


def suite_copies(bench: Bench) -> dict[str, Any]:
    """Copies on other nodes: the save stall with ``Replicas(2)`` against without (a training
    loop), replication throughput against raw gloo, the restore of a lost node from its peers
    against the same bytes from the cold tier; 4 ranks as 2 nodes, hot tier on disk and tmpfs."""
    from benchmarks.jobs import copies

    profile = bench.profile
    print(
        f"  copies: {profile.copies_size // MiB} MiB over 4 ranks as 2 nodes, best of {profile.copies_reps}: "
        f"a training loop saving every {profile.copies_every} steps with and without Replicas(2), "
        "replication against raw gloo, a lost node restored from its peers and from the cold tier",
        flush=True,
    )
    bench.jobs += 1
    spec = {
        "job": f"copies{bench.jobs}",
        "scratch": str(bench.scratch / "copies"),
        "bytes": profile.copies_size,
        "reps": profile.copies_reps,
        "saves": profile.copies_saves,
        "every": profile.copies_every,
        "step_seconds": profile.copies_step_seconds,
        "layers": profile.copies_layers,
        "phases": ["stall", "copies"],
    }
    try:
        records = copies.launch(spec, bench.scratch / f"copies{bench.jobs}-out")
    finally:
        shutil.rmtree(bench.scratch / "copies", ignore_errors=True)
    return {
        **{k: spec[k] for k in ("bytes", "reps", "saves", "every", "step_seconds", "layers")},
        "world": copies.WORLD,
        "local_world": copies.LOCAL,
        "records": records,
    }


STALL_SYSTEMS = (
    "sync_tiered",
    "ours_reuse",
    "ours_overlap",
    "ours_fresh",
    "dcp_async",
    "dcp_async_cached",
    "torch_checkpointing",
)

SUITES: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "cpu": suite_cpu,
    "save": suite_save,
    "latency": suite_latency,
    "migration": suite_migration,
    "load": suite_load,
    "scaling": suite_scaling,
    "gpu": suite_gpu,
    "cold-down": suite_cold_down,
    "perf": suite_perf,
    "preemption": suite_preemption,
    "copies": suite_copies,
}
