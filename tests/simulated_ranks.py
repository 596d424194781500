"""A save by W ranks in one process: DCP's save steps replayed with one TieredWriter per rank.

What ``dcp.save`` does across a process group (plan locally, plan globally on the
coordinator, write on every rank, finish on the coordinator), done in turn for each rank, so a
test can commit a checkpoint of 6 or 12 ranks without starting 12 processes. Every rank
saves its own tensors ``r<rank>.*`` (so nothing is deduplicated between ranks) and writes real
files through the real writer; only the collectives are replaced by a loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tierstore import TieredWriter
from tierstore.format.manifest import Manifest
from tierstore.tiers.tier import Store


def rank_state(rank: int, step: int = 1) -> dict[str, torch.Tensor]:
    """Two tensors, so a writer with two threads writes two files."""
    base = torch.arange(16, dtype=torch.float32) + 100 * rank + step
    return {f"r{rank}.a": base, f"r{rank}.b": -base}


def save_ranks(
    world: int, hot: str | Store, cold: str | None = None, *, step: int = 1, **writer_options: Any
) -> tuple[Manifest, list[TieredWriter]]:
    """Commit step ``step`` as saved by ``world`` ranks; the manifest and every rank's writer.

    Exceptions raised by the writer (in ``prepare_global_plan``, say) propagate as they are.
    """
    writers = [TieredWriter(hot, cold, step=step, **writer_options) for _ in range(world)]
    planners = [DefaultSavePlanner() for _ in range(world)]
    local = []
    for rank, (writer, planner) in enumerate(zip(writers, planners)):
        writer.reset()
        planner.set_up_planner(
            state_dict=rank_state(rank, step), storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local.append(writer.prepare_local_plan(planner.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(local)
    plans = writers[0].prepare_global_plan(plans)
    results = []
    for rank, (writer, planner) in enumerate(zip(writers, planners)):
        final = planner.finish_plan(plans[rank])
        future = writer.write_data(final, planner)
        future.wait()
        results.append(future.value())
    writers[0].finish(metadata=metadata, results=results)
    assert writers[0].manifest is not None
    return writers[0].manifest, writers


def load_state(world: int, step: int = 1) -> dict[str, torch.Tensor]:
    """A load target for every rank's tensor, zeroed."""
    return {k: torch.zeros_like(v) for rank in range(world) for k, v in rank_state(rank, step).items()}


def holds_saved(state: dict[str, torch.Tensor], world: int, step: int = 1) -> bool:
    expected = {k: v for rank in range(world) for k, v in rank_state(rank, step).items()}
    return state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
