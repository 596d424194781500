"""One rank of a training job that a scheduler preempts: ``python -m benchmarks.jobs.preemption_loops SPEC``.

``benchmarks/jobs/preemption_exit.py`` starts it and sends the SIGTERM. Every loop trains
the same model (``spec["layers"]`` square ``Linear`` layers, FSDP2 ``fully_shard`` over
the ranks on gloo, AdamW, so the model and optimizer state come to ``spec["bytes"]``), one
step every ``spec["step_seconds"]`` or so, writes its pid (``out/pid-<rank>``) and each step
it finished (``out/step-<rank>``), and never saves on its cadence: the only checkpoint is the
notice's. ``spec["loop"]`` is one of:

* ``readme``: the README's loop, ``manager.save(step, state)`` every step and never a look
  at ``manager.preempted`` (2 ranks, ``tests/launch.py``'s environment);
* ``preempted``: the documented loop, ``if manager.save(step, state) and manager.preempted:
  break`` then ``manager.close()``;
* ``torchtitan``: torchtitan's containers and ``TieredCheckpointManager``, the trainer
  stopping on ``checkpointer.preempted`` (``should_continue_training``'s one line) and
  closing;
* ``lightning``: ``TierstoreCheckpoint`` in a Lightning ``Trainer`` (``ModelParallelStrategy``,
  ``devices=2``), started once as ``python train.py`` is: Lightning's launcher starts rank 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BATCH = 16


def width(size: int, layers: int) -> int:
    """The side of ``layers`` square layers whose weights and AdamW's two moments are ``size``
    bytes of float32."""
    return max(8, int((size / (3 * 4 * layers)) ** 0.5))


def build_model(spec: dict[str, Any]) -> nn.Sequential:
    torch.manual_seed(0)
    side = width(spec["bytes"], spec["layers"])
    return nn.Sequential(*(nn.Linear(side, side) for _ in range(spec["layers"])))


def shard(model: nn.Sequential, mesh: Any = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch(step: int, side: int) -> torch.Tensor:
    return torch.randn(BATCH, side, generator=torch.Generator().manual_seed(step))


def train_step(model: nn.Sequential, optim: torch.optim.Optimizer, step: int, spec: dict[str, Any]) -> None:
    started = time.monotonic()
    model(batch(step, width(spec["bytes"], spec["layers"]))).square().mean().backward()
    optim.step()
    optim.zero_grad()
    time.sleep(max(0.0, spec["step_seconds"] - (time.monotonic() - started)))  # the rest of a step


class Marks:
    """What the driver reads while the job runs: this rank's pid, then each step it finished."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        (out / f"pid-{rank}").write_text(str(os.getpid()))

    def step(self, step: int) -> None:
        temp = self.out / f"step-{self.rank}.tmp"
        temp.write_text(str(step))
        os.replace(temp, self.out / f"step-{self.rank}")


def manager_loop(spec: dict[str, Any]) -> None:
    """The README's loop or the documented one (module docstring)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tierstore import CheckpointManager, PreemptionOptions, Retention

    dist.init_process_group("gloo")
    marks = Marks(Path(spec["out"]), dist.get_rank())
    model = build_model(spec)
    shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(
        spec["hot"],
        spec["cold"],
        save_every=10**9,  # the notice's save is the only one
        retention=Retention(hot_min_free=None),
        preemption=PreemptionOptions(grace_seconds=spec["grace"]),
    )
    for step in range(1, 10**9):
        train_step(model, optim, step, spec)
        msd, osd = get_state_dict(model, optim)
        if spec["loop"] == "readme":
            manager.save(step, {"model": msd, "optim": osd})
        elif manager.save(step, {"model": msd, "optim": osd}) and manager.preempted:
            break
        marks.step(step)
    manager.close()
    dist.destroy_process_group()


class TrainState:
    """torchtitan's trainer saves its step counter with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def torchtitan_loop(spec: dict[str, Any]) -> None:
    """torchtitan's trainer, its loop cut to what touches the checkpointer (module docstring)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from tierstore.integrations.torchtitan import TieredCheckpointManager

    dist.init_process_group("gloo")
    marks = Marks(Path(spec["out"]), dist.get_rank())
    model = build_model(spec)
    shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10**9
    )
    state = TrainState()
    checkpointer = TieredCheckpointManager.Config(
        enable=True,
        folder=spec["hot"],
        cold=spec["cold"],
        interval=10**9,  # the notice's save is the only one
        async_mode="disabled",
        last_save_model_only=False,
        preemption_grace_seconds=spec["grace"],
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
    )
    while not checkpointer.preempted:  # should_continue_training()'s one line
        state.step += 1
        started = time.monotonic()
        model(batch(state.step, width(spec["bytes"], spec["layers"]))).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        time.sleep(max(0.0, spec["step_seconds"] - (time.monotonic() - started)))
        checkpointer.save(state.step, last_step=False)
        marks.step(state.step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    dist.destroy_process_group()


def lightning_loop(spec: dict[str, Any]) -> None:
    """``python train.py`` with ``TierstoreCheckpoint`` (module docstring); Lightning's own
    SIGTERM path ends it: ``SIGTERMException`` (a ``SystemExit``) through the script's end."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tierstore import PreemptionOptions
    from tierstore.integrations.lightning import TierstoreCheckpoint

    out = Path(spec["out"])
    side = width(spec["bytes"], spec["layers"])

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(spec)

        def configure_model(self) -> None:
            assert self.device_mesh is not None
            shard(self.net, self.device_mesh["data_parallel"])

        def on_train_start(self) -> None:
            self.marks = Marks(out, self.global_rank)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            started = time.monotonic()
            loss: torch.Tensor = self.net(batch).square().mean()
            time.sleep(max(0.0, spec["step_seconds"] - (time.monotonic() - started)))
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.marks.step(self.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Batches(torch.utils.data.Dataset[torch.Tensor]):
        """More steps than a run takes, none held in memory: the epoch's save never comes."""

        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.randn(side, generator=torch.Generator().manual_seed(index))

    checkpoint = TierstoreCheckpoint(
        spec["hot"],
        spec["cold"],
        every_n_epochs=1,
        save_on_train_epoch_end=True,
        manager_options={"preemption": PreemptionOptions(grace_seconds=spec["grace"])},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(Net(), torch.utils.data.DataLoader(Batches(), batch_size=BATCH))


LOOPS = {
    "readme": manager_loop,
    "preempted": manager_loop,
    "torchtitan": torchtitan_loop,
    "lightning": lightning_loop,
}

if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    spec = json.loads(Path(sys.argv[1]).read_text())
    LOOPS[spec["loop"]](spec)
