"""TrainingState in one process: every part round-trips through a tierstore checkpoint."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import ResumableSampler, TieredReader, TieredWriter
from tierstore.errors import ConfigError
from tierstore.resume.state import (
    ResumePlanner,
    TrainingState,
    capture_rng,
    is_per_rank_key,
    reseed,
    restore_rng,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return TrainingState(model, optim, sched, sampler=ResumableSampler(30, rank=0, world_size=1, seed=seed))


def train(ts: TrainingState, steps: int) -> list[float]:
    losses = []
    sampler = ts.sampler
    assert isinstance(sampler, ResumableSampler) and ts.optimizer is not None and ts.scheduler is not None
    data = torch.linspace(-1, 1, 120).reshape(30, 4)
    it = iter(sampler)
    for _ in range(steps):
        x = data[[next(it), next(it)]]
        loss = ts.model(x).pow(2).mean()  # dropout: draws from the torch RNG
        loss.backward()
        ts.optimizer.step()
        ts.optimizer.zero_grad()
        ts.scheduler.step()  # type: ignore[attr-defined]
        ts.step += 1
        losses.append(loss.item())
    return losses


def test_a_resume_continues_exactly_where_the_run_stopped(tmp_path: Path) -> None:
    ts = make(0)
    train(ts, 3)
    random.seed(11)
    np.random.seed(12)
    dcp.save({"train": ts}, storage_writer=TieredWriter(str(tmp_path), step=3))
    expected = (train(ts, 4), random.random(), float(np.random.rand()))
    fresh = make(1)  # different init, RNG, data seed: the load must overwrite all of it
    dcp.load({"train": fresh}, storage_reader=TieredReader(str(tmp_path)))
    assert fresh.step == 3 and fresh.sampler.state_dict()["position"] == 6  # type: ignore[union-attr]
    assert (train(fresh, 4), random.random(), float(np.random.rand())) == expected


def test_excluded_parts_are_neither_saved_nor_loaded(tmp_path: Path) -> None:
    ts = make(0)
    train(ts, 2)
    dcp.save(
        {"train": TrainingState(ts.model, ts.optimizer, exclude=("rng", "step"))},
        storage_writer=TieredWriter(str(tmp_path), step=2),
    )
    reader = TieredReader(str(tmp_path))
    keys = set(reader.read_metadata().state_dict_metadata)
    assert any(k.startswith("train.optim.state.") for k in keys)
    assert not any(k.startswith(("train.rng", "train.step", "train.scheduler", "train.data")) for k in keys)
    with pytest.raises(ConfigError, match="unknown parts"):
        TrainingState(ts.model, exclude=("weights",))


def test_rng_round_trip_covers_python_numpy_and_torch() -> None:
    state = capture_rng()
    values = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    restore_rng(state)
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == values


def test_another_world_size_reseeds_from_seed_step_and_rank() -> None:
    ts = make(0)
    ts.step, ts.seed = 7, 5
    state = ts.state_dict()
    state["rng"]["world_size"] = 4  # saved by 4 ranks, loaded by 1
    torch.manual_seed(123)
    ts.load_state_dict(state)
    after = torch.rand(2)
    reseed(5, 7, 0)
    assert torch.equal(torch.rand(2), after)


def test_resume_planner_tolerates_only_absent_per_rank_keys(tmp_path: Path) -> None:
    saved = {"w": torch.ones(3), "rng": {"world_size": 1, "rank0": {"torch": torch.zeros(4)}}}
    dcp.save(saved, storage_writer=TieredWriter(str(tmp_path), step=1))
    grown = {"w": torch.zeros(3), "rng": {"world_size": 0, "rank1": {"torch": torch.full((4,), 9.0)}}}
    with pytest.raises(CheckpointException, match="Missing key"):
        dcp.load(grown, storage_reader=TieredReader(str(tmp_path)))
    planner = ResumePlanner()
    dcp.load(grown, storage_reader=TieredReader(str(tmp_path)), planner=planner)
    assert planner.missing == ["rng.rank1.torch"]
    assert torch.equal(grown["w"], torch.ones(3)) and grown["rng"]["world_size"] == 1
    assert torch.equal(grown["rng"]["rank1"]["torch"], torch.full((4,), 9.0))  # left as it was
    with pytest.raises(CheckpointException, match="Missing key"):
        dcp.load(
            {"other": torch.zeros(1)}, storage_reader=TieredReader(str(tmp_path)), planner=ResumePlanner()
        )


def test_per_rank_keys() -> None:
    assert is_per_rank_key("train.rng.rank12.torch") and is_per_rank_key("rng.rank0")
    assert not is_per_rank_key("train.rng.world_size") and not is_per_rank_key("train.rank0")
