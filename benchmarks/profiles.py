"""Benchmark profiles: what each run measures, at which sizes, how many times."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.measure import GiB, MiB


@dataclass(frozen=True)
class Profile:
    name: str
    reps: int  # repetitions of each measurement that involves S3 (medians are reported)
    local_reps: int  # repetitions of local-disk saves next to them (cheap, and the noisiest)
    save_sizes: tuple[int, ...]  # item 1: every writer, 2 ranks (total bytes)
    hot_only_sizes: tuple[int, ...]  # items 1/3/7 at sizes where moto would take too long
    hot_only_reps: int
    skip_variants: tuple[str, ...]  # writers left out of item 1 (time)
    latency_size: int  # item 2
    latency_ms: tuple[int, ...]
    latency_variants: tuple[str, ...]
    migration_size: int  # item 4: the checkpoint of the concurrency sweep
    migration_sweep: tuple[int, ...]  # parts in flight per file
    migration_sizes: tuple[int, ...]  # item 6: migrator memory by checkpoint size, ascending
    memory_reps: int
    load_size: int  # item 5
    scaling_size: int  # item 7: the same total bytes on 1, 2, 4 ranks
    scaling_ranks: tuple[int, ...]
    scaling_reps: int
    cpu_size: int  # item 3's CPU-only measurements (one process, tmpfs)
    gpu_size: int  # item 8
    part_size: int = 16 * MiB  # tierstore's S3 default, used for both sides of item 4
    default_inflight: int = 4  # tierstore's S3 default max_concurrency
    cold_down_size: int = 64 * MiB  # item 9: saves with the cold tier down, one process
    cold_down_reps: int = 9  # best of these is compared (each save is a fraction of a second)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Profile(
    name="quick", reps=3, local_reps=5,
    save_sizes=(256 * MiB,), hot_only_sizes=(1 * GiB,), hot_only_reps=3,
    skip_variants=("s3torch_async",),
    latency_size=64 * MiB, latency_ms=(0, 50, 200),
    latency_variants=("tiered_async", "fsspec_sync"),
    migration_size=256 * MiB, migration_sweep=(1, 4),
    migration_sizes=(128 * MiB, 256 * MiB, 512 * MiB), memory_reps=1,
    load_size=256 * MiB, scaling_size=256 * MiB, scaling_ranks=(1, 2, 4), scaling_reps=3,
    cpu_size=512 * MiB, gpu_size=1 * GiB,
)

FULL = Profile(
    name="full", reps=3, local_reps=7,
    # moto keeps what it stores in memory: the S3 writers at 4 GiB drove its server past 14 GiB
    # and the kernel's OOM killer stopped the run on a 23.5 GiB machine; 4 GiB runs locally.
    save_sizes=(256 * MiB, 1 * GiB), hot_only_sizes=(4 * GiB,), hot_only_reps=5,
    skip_variants=(),
    latency_size=256 * MiB, latency_ms=(0, 50, 200),
    latency_variants=("tiered_async", "fsspec_sync", "fsspec_async", "s3torch_sync"),
    migration_size=1 * GiB, migration_sweep=(1, 2, 4, 8, 16),
    migration_sizes=(256 * MiB, 1 * GiB, 2 * GiB), memory_reps=2,
    load_size=1 * GiB, scaling_size=1 * GiB, scaling_ranks=(1, 2, 4), scaling_reps=5,
    cpu_size=1 * GiB, gpu_size=4 * GiB, cold_down_size=256 * MiB,
)

PROFILES = {p.name: p for p in (QUICK, FULL)}


def checkpoint_name(size: int) -> str:
    """The name of the hot checkpoint of ``size`` bytes that the migration suite writes."""
    return f"size-{size // MiB:06d}"
