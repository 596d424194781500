"""What every rank of a benchmark job shares: its context, the state it saves, and fresh,
cleaned-up places to save to."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks.infra.measure import MiB
from benchmarks.infra.servers import S3Target, remove_prefix
from benchmarks.jobs import writers

TENSOR_BYTES = 16 * MiB  # per tensor and rank: many mid-sized tensors, like a model
MAX_TENSORS = 128


@dataclass
class Context:
    spec: dict[str, Any]
    rank: int
    world: int
    group: dist.ProcessGroup  # checkpoint collectives only
    mesh: DeviceMesh
    scratch: Path
    targets: dict[str, S3Target] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # case -> first error

    @property
    def direct(self) -> S3Target | None:
        return self.targets.get("direct")

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


# -- state ---------------------------------------------------------------------------------


def make_state(ctx: Context, total: int, seed: int = 0) -> dict[str, Any]:
    """``total`` bytes of float32 DTensors sharded over the ranks (each rank holds its own)."""
    per_rank = total // ctx.world
    count = max(1, min(MAX_TENSORS, per_rank // TENSOR_BYTES))
    numel = per_rank // count // 4
    gen = torch.Generator().manual_seed(1000 * seed + ctx.rank)
    return {
        f"layers.{i:03d}.weight": DTensor.from_local(
            torch.rand(numel, generator=gen), ctx.mesh, [Shard(0)], run_check=False
        )
        for i in range(count)
    }


def local_views(state: dict[str, Any]) -> list[memoryview]:
    return [memoryview(t.to_local().numpy()).cast("B") for t in state.values()]


def local_bytes(state: dict[str, Any]) -> int:
    return sum(len(v) for v in local_views(state))


# -- one save ------------------------------------------------------------------------------


def where(ctx: Context, label: str, endpoint: str) -> writers.Where:
    target = ctx.targets.get(endpoint)
    local = ctx.scratch / label
    local.mkdir(parents=True, exist_ok=True)
    job = ctx.spec["job"]
    return writers.Where(str(local), target.url(job, label) if target else None, target)


def cleanup(ctx: Context, place: writers.Where) -> None:
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(place.local, ignore_errors=True)
        if place.s3 is not None and place.target is not None:
            remove_prefix(place.target, place.s3)
    dist.barrier()
