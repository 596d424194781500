"""What each simulated rank saves and loads, and DCP's planning steps for it.

Every rank holds two tensors of its own (with ``thread_count=2`` the writer puts them in two
files: F = 2 files per rank) and the same replicated items (a step counter and a shared
vector, as optimizer state and param groups are), which DCP's planner dedups to one rank's
files, so a load must read parts of another rank's files. Values depend on the rank, so a
load that delivered the wrong bytes fails the check in :func:`check_loaded`. Tensors are
whole multiples of 4 KiB, the raw encoding's item alignment: with smaller ones the padding
between items, not the items, would dominate what a coalesced range read fetches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

__all__ = [
    "OWN_NUMEL",
    "SHARED_NUMEL",
    "state_dict",
    "empty_like_state",
    "save_planner",
    "load_planner",
    "plan_bytes",
    "check_loaded",
]

OWN_NUMEL = 1024  # float32 elements per own tensor: 4 KiB
SHARED_NUMEL = 4096  # the replicated vector: 16 KiB


def state_dict(rank: int) -> dict[str, Any]:
    base = float(rank * 10)
    return {
        f"rank{rank}.a": torch.arange(OWN_NUMEL, dtype=torch.float32) + base,
        f"rank{rank}.b": torch.full((OWN_NUMEL,), base + 1.0),
        "shared.vector": torch.linspace(0.0, 1.0, SHARED_NUMEL),
        "shared.step": torch.tensor(1234, dtype=torch.int64),
    }


def empty_like_state(rank: int) -> dict[str, Any]:
    return {key: torch.zeros_like(value) for key, value in state_dict(rank).items()}


def save_planner(rank: int, storage_meta: Any) -> DefaultSavePlanner:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict(rank), storage_meta, rank == 0)
    return planner


def load_planner(rank: int, target: dict[str, Any], metadata: Metadata) -> DefaultLoadPlanner:
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, rank == 0)
    return planner


def plan_bytes(plan: LoadPlan, metadata: Metadata) -> int:
    """Stored bytes the plan's items occupy: what a rank needs to read, at least."""
    storage = metadata.storage_data or {}
    total = 0
    for item in plan.items:
        info = storage.get(item.storage_index)
        total += int(getattr(info, "length", 0) or 0)
    return total


def check_loaded(rank: int, target: dict[str, Any]) -> None:
    """Raise if a rank's loaded state differs from what it saved."""
    for key, expected in state_dict(rank).items():
        if not torch.equal(target[key], expected):
            raise AssertionError(f"rank {rank} loaded wrong values for {key}")
