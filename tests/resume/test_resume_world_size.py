"""Resume under another world size through the manager (issue 16 item 6).

Real gloo jobs of FSDP2 ranks on CPU: a ``TrainingState`` (sharded model and AdamW state,
step, per-rank RNG) saved by 2 ranks loads on 3, and one saved by 4 loads on 2, through
``CheckpointManager.load_latest`` with no planner given; the loaded state equals the saved one
bit for bit. A planner given explicitly is the one used: DCP's own default planner fails the
2 -> 3 load with an error that names both world sizes and the way out, not DCP's bare
missing-key error, and a planner of the test's own is seen planning.

This file is also the job each rank runs (``python tests/resume/test_resume_world_size.py SPEC``).
"""

from __future__ import annotations

import datetime
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

DIM = 12  # rows of the first layer: sharded 6/6 on 2 ranks, 4/4/4 on 3, 3/3/3/3 on 4


def run(spec: dict[str, Any], world: int) -> None:
    from launch import run_job

    job = run_job(spec, world, script=Path(__file__))
    assert job.ok, job.describe()


def read(out: Path, name: str) -> Any:
    return json.loads((out / name).read_text())


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 3), (4, 2)])
def test_a_new_world_size_resumes_through_the_manager(tmp_path: Path, saved_by: int, loaded_by: int) -> None:
    hot, out = str(tmp_path / "hot"), tmp_path / "out"
    out.mkdir()
    run({"op": "save", "hot": hot, "out": str(out), "step": 3}, saved_by)
    saved = read(out, "saved.json")
    run({"op": "load", "hot": hot, "out": str(out), "explicit": loaded_by > saved_by}, loaded_by)
    loaded = read(out, "loaded.json")
    assert loaded["step"] == 3 and loaded["state_step"] == 3
    assert loaded["state"] == saved["state"]  # model and optimizer, every value bit for bit
    assert loaded["reseeded"] == [True] * loaded_by  # the saved RNG streams cannot continue
    if loaded_by > saved_by:
        explicit = read(out, "explicit.json")
        error = explicit["dcp_default"]
        assert error["type"] == "ConfigError" and error["checkpoint"] == "step-0000000003"
        for words in ("saved by 2 ranks", "by 3", "train.rng.rank2", "planner=tierstore.ResumePlanner"):
            assert words in error["message"], (words, error["message"])
        assert explicit["own_planner_planned"] is True and explicit["own_planner_step"] == 3


def test_the_same_world_size_keeps_every_key_required(tmp_path: Path) -> None:
    # One process, no process group: saved and loaded by a world of 1.
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from tierstore import CheckpointManager, ConfigError, TrainingState

    hot = str(tmp_path / "hot")
    manager = CheckpointManager(hot, save_every=1)
    manager.save(3, {"train": TrainingState(torch.nn.Linear(2, 2), step=3)})
    manager.wait()
    extra = TrainingState(torch.nn.Linear(2, 2), extra={"rng": _PerRankExtra()})
    # A per-rank key the checkpoint lacks at its own world size is a real mismatch: DCP's
    # error stands, named with the checkpoint (the default planner is lenient only when the
    # world size changed).
    with pytest.raises(
        ConfigError, match=r"Missing key in checkpoint state_dict: train\.extra\.rng\.rank9"
    ) as mismatch:
        manager.load_latest({"train": extra})
    assert isinstance(mismatch.value.__cause__, CheckpointException)  # DCP's error, chained
    assert isinstance(mismatch.value, CheckpointException)  # still caught as DCP's
    plain = TrainingState(torch.nn.Linear(2, 2))
    assert manager.load_latest({"train": plain}) == 3 and plain.step == 3
    manager.close()


# -- the job each rank runs ---------------------------------------------------------------------


def build(world: int, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierstore import TrainingState

    torch.manual_seed(seed)  # the same init on every rank: fully_shard shards the full model
    model = nn.Sequential(nn.Linear(5, DIM), nn.ReLU(), nn.Linear(DIM, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainingState(model, optim, seed=5)


def digest(ts: Any) -> dict[str, Any]:
    """Every parameter and optimizer state value, gathered whole (a collective), as exact floats."""
    state: dict[str, Any] = {}
    for name, param in ts.model.named_parameters():
        state[name] = param.full_tensor().flatten().tolist()
        for key, value in sorted(ts.optimizer.state[param].items()):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[f"{name}/{key}"] = full.flatten().tolist()
    return state


def op_save(spec: dict[str, Any], rank: int, world: int) -> None:
    import torch

    from tierstore import CheckpointManager

    ts = build(world, seed=1)
    for _ in range(spec["step"]):  # a few real steps, so AdamW has state to save
        ts.model(torch.randn(4, 5)).pow(2).mean().backward()
        ts.optimizer.step()
        ts.optimizer.zero_grad()
    ts.step = spec["step"]
    manager = CheckpointManager(spec["hot"], save_every=1)
    manager.save(spec["step"], {"train": ts})
    manager.close()
    saved = digest(ts)
    if rank == 0:
        Path(spec["out"], "saved.json").write_text(json.dumps({"state": saved}))


def op_load(spec: dict[str, Any], rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from tierstore import CheckpointManager, ResumePlanner
    from tierstore.errors import TierstoreError
    from tierstore.resume.state import reseed

    manager = CheckpointManager(spec["hot"])
    out = Path(spec["out"])
    if spec.get("explicit"):
        explicit: dict[str, Any] = {}
        try:
            manager.load_latest({"train": build(world, seed=2)}, planner=DefaultLoadPlanner())
        except TierstoreError as err:
            explicit["dcp_default"] = {
                "type": type(err).__name__,
                "message": str(err),
                "checkpoint": err.checkpoint,
            }

        class Recording(ResumePlanner):
            planned = False

            def create_local_plan(self) -> Any:
                Recording.planned = True
                return super().create_local_plan()

        explicit["own_planner_step"] = manager.load({"train": build(world, seed=3)}, planner=Recording())
        explicit["own_planner_planned"] = Recording.planned
        if rank == 0:
            (out / "explicit.json").write_text(json.dumps(explicit))
    ts = build(world, seed=4)  # a different init: only the load can make it equal
    step = manager.load_latest({"train": ts})
    # Under a new world size TrainingState reseeds every rank from (seed, step, rank).
    after_load = torch.get_rng_state()
    reseed(ts.seed, ts.step, rank)
    reseeded = [None] * world
    dist.all_gather_object(reseeded, torch.equal(after_load, torch.get_rng_state()))
    loaded = digest(ts)
    if rank == 0:
        (out / "loaded.json").write_text(
            json.dumps({"step": step, "state_step": ts.step, "state": loaded, "reseeded": reseeded})
        )
    manager.close()


class _PerRankExtra:
    """State saved under a per-rank key (``rng.rank9``) that no checkpoint here has."""

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"rank9": torch.zeros(1)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    import torch.distributed as dist
    from launch import leave_cleanly

    warnings.filterwarnings("ignore")
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    {"save": op_save, "load": op_load}[spec["op"]](spec, rank, world)
    leave_cleanly()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: launch.py
    main()
