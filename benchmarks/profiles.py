"""Benchmark profiles: what each run measures, at which sizes, how many times."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.infra.measure import GiB, MiB


@dataclass(frozen=True)
class Profile:
    """What one run measures, at which sizes (total bytes over the ranks), how many times.

    Fields are grouped by the suite that reads them (``benchmarks/jobs/suites.py``).
    """

    name: str
    reps: int  # repetitions of each measurement that involves S3 (medians are reported)
    local_reps: int  # repetitions of local-disk saves next to them (cheap, and the noisiest)
    # save: stall, hot write throughput, save memory, time vs bytes (every writer, 2 ranks)
    save_sizes: tuple[int, ...]
    hot_only_sizes: tuple[int, ...]  # local writers only: moto would take too long
    hot_only_reps: int
    save_skip_variants: tuple[str, ...]  # writers left out of the save suite (time)
    # latency: the same saves through a proxy adding latency to every S3 request
    latency_size: int
    latency_ms: tuple[int, ...]
    latency_variants: tuple[str, ...]
    # migration: throughput against plain s3fs, over parts in flight; memory by size
    migration_sweep_size: int  # the checkpoint of the parts-in-flight sweep
    migration_sweep: tuple[int, ...]  # parts in flight per file
    migration_memory_sizes: tuple[int, ...]  # the migrator's memory by checkpoint size, ascending
    migration_memory_reps: int
    load_size: int  # load: hot and cold-only loads, with and without CRC32C
    scaling_size: int  # scaling: the same total bytes on each of scaling_ranks
    scaling_ranks: tuple[int, ...]
    scaling_reps: int
    cpu_size: int  # cpu: the CPU-only costs of a save (one process, tmpfs)
    gpu_size: int  # gpu: pinned-memory staging against DCP's default stager
    part_size: int = 16 * MiB  # tierstore's S3 default, used for both sides of the migration
    default_inflight: int = 4  # tierstore's S3 default max_concurrency
    cold_down_size: int = 64 * MiB  # cold-down: saves with the cold tier down, one process
    cold_down_reps: int = 9  # best of these is compared (each save is a fraction of a second)
    # perf: issue 14's targets, one process (benchmarks/jobs/perf_io.py, perf_stall.py)
    perf_size: int = 512 * MiB  # the state of the measurements
    perf_reps: int = 5  # best of these per side
    perf_saves: int = 6  # saves per system in the stall job; 2..N are the steady state
    perf_loop_reps: int = 10  # reps of the training-shaped loop (perf_loop.py), each shown
    # preemption: the save on a notice against a plain sync save, one process
    preemption_size: int = 256 * MiB
    preemption_reps: int = 5  # best of these per kind, with the spread
    preemption_grace: float = 30.0  # the default PreemptionOptions(grace_seconds=)
    # ... and from the signal to the exit, per training loop: 2 ranks, model + AdamW state
    preemption_exit_size: int = 64 * MiB
    preemption_exit_reps: int = 3  # best of these per loop, with the spread (a rep: 40 s on 2 cores)
    # copies: copies on other nodes, 4 ranks as 2 nodes (benchmarks/jobs/copies.py)
    copies_size: int = 256 * MiB  # the state over the 4 ranks (64 MiB a rank)
    copies_reps: int = 3  # best of these per side, with the spread
    copies_saves: int = 5  # saves per training loop; the first (staging allocated) is left out
    copies_every: int = 3  # steps between saves
    copies_step_seconds: float = 1.0  # a step, at least: its compute, then the host idle
    copies_layers: int = 2  # square Linear layers of the loop's model (FSDP2 + AdamW)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Profile(
    name="quick",
    reps=3,
    local_reps=5,
    save_sizes=(256 * MiB,),
    hot_only_sizes=(1 * GiB,),
    hot_only_reps=3,
    save_skip_variants=("s3torch_async",),
    latency_size=64 * MiB,
    latency_ms=(0, 50, 200),
    latency_variants=("tiered_async", "fsspec_sync"),
    migration_sweep_size=256 * MiB,
    migration_sweep=(1, 4),
    migration_memory_sizes=(128 * MiB, 256 * MiB, 512 * MiB),
    migration_memory_reps=1,
    load_size=256 * MiB,
    scaling_size=256 * MiB,
    scaling_ranks=(1, 2, 4),
    scaling_reps=3,
    cpu_size=512 * MiB,
    gpu_size=1 * GiB,
)

FULL = Profile(
    name="full",
    reps=3,
    local_reps=7,
    # moto keeps what it stores in memory: the S3 writers at 4 GiB drove its server past 14 GiB
    # and the kernel's OOM killer stopped the run on a 23.5 GiB machine; 4 GiB runs locally.
    save_sizes=(256 * MiB, 1 * GiB),
    hot_only_sizes=(4 * GiB,),
    hot_only_reps=5,
    save_skip_variants=(),
    latency_size=256 * MiB,
    latency_ms=(0, 50, 200),
    latency_variants=("tiered_async", "fsspec_sync", "fsspec_async", "s3torch_sync"),
    migration_sweep_size=1 * GiB,
    migration_sweep=(1, 2, 4, 8, 16),
    migration_memory_sizes=(256 * MiB, 1 * GiB, 2 * GiB),
    migration_memory_reps=2,
    load_size=1 * GiB,
    scaling_size=1 * GiB,
    scaling_ranks=(1, 2, 4),
    scaling_reps=5,
    cpu_size=1 * GiB,
    gpu_size=4 * GiB,
    cold_down_size=256 * MiB,
    perf_reps=7,
    perf_saves=10,
    preemption_size=1 * GiB,
    preemption_reps=7,
    preemption_exit_size=256 * MiB,
    preemption_exit_reps=5,
    copies_size=1 * GiB,
    copies_reps=5,
    copies_saves=8,
)

# Every suite end to end in a few minutes, at sizes too small for its figures to mean anything:
# proves the jobs run (``make bench-smoke``), never a report to publish.
SMOKE = Profile(
    name="smoke",
    reps=1,
    local_reps=1,
    save_sizes=(32 * MiB,),
    hot_only_sizes=(64 * MiB,),
    hot_only_reps=1,
    save_skip_variants=("s3torch_async",),
    latency_size=16 * MiB,
    latency_ms=(0, 50),
    latency_variants=("tiered_async", "fsspec_sync"),
    migration_sweep_size=32 * MiB,
    migration_sweep=(1, 4),
    migration_memory_sizes=(32 * MiB, 64 * MiB),
    migration_memory_reps=1,
    load_size=32 * MiB,
    scaling_size=32 * MiB,
    scaling_ranks=(1, 2),
    scaling_reps=1,
    cpu_size=32 * MiB,
    gpu_size=64 * MiB,
    cold_down_size=16 * MiB,
    cold_down_reps=1,
    perf_size=32 * MiB,
    perf_reps=1,
    perf_saves=3,
    perf_loop_reps=2,
    preemption_size=32 * MiB,
    preemption_reps=1,
    preemption_exit_size=8 * MiB,
    preemption_exit_reps=1,
    copies_size=32 * MiB,
    copies_reps=1,
    copies_saves=2,
    copies_every=2,
    copies_step_seconds=0.3,
)

PROFILES = {p.name: p for p in (QUICK, FULL, SMOKE)}


def checkpoint_name(size: int) -> str:
    """The name of the hot checkpoint of ``size`` bytes that the migration suite writes."""
    return f"size-{size // MiB:06d}"
