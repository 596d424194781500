"""Running the documentation's Python blocks: the Markdown parser, the fixtures for what the
blocks elide, and the worker process that runs them (tests/test_docs_code.py drives it).

A block runs *as written*, in a fresh namespace and a fresh directory, with two exceptions,
both explicit here:

* the objects a block leaves to the reader (a model, an optimizer, ``state``, a ``manager``
  that already saved, ``dist``) come from the setup named for it in :data:`SETUPS`;
* the example locations of the docs (:data:`LOCATIONS`: ``/nvme/run1``, ``s3://bucket/run1``)
  are pointed at the block's own directory and at a fresh bucket on the moto S3 server.

The worker is one real ``torch.distributed`` job of one rank (gloo), so blocks that make
process groups or call ``dcp.async_save`` run as they would in training; it stays up for
the whole test module because importing torch and joining a group costs seconds.

A block that needs processes of its own (:data:`LAUNCHED`) runs instead as the ``__main__``
module of fresh interpreters, on one or more ranks of a tests/launch.py job
(tests/docs_job.py): a script's ``if __name__ == "__main__":`` guard, a writer process that
multiprocessing spawns from it, a trainer that joins a 2-rank group all work as in a user's job.

A block that is deliberately not runnable is marked in the Markdown, right before its fence:
``<!-- not run: why -->``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore import Store

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_SKIP = re.compile(r"<!--\s*not run(?P<colon>:?)(?P<reason>.*?)-->")


@dataclass(frozen=True)
class Block:
    """One fenced Python block: where it is, its code, and why it is not run (if it is not)."""

    file: str  # relative to the repository root
    index: int  # among the Python blocks of its file, from 0
    line: int  # of the opening fence, from 1
    source: str
    skip: str | None = None  # the reason given in a `<!-- not run: ... -->` marker

    @property
    def id(self) -> str:
        return f"{self.file}#{self.index}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.source.splitlines() if ln.strip()), "")


def fenced(text: str) -> Iterator[tuple[int, str, str, str]]:
    """``(line, info, body, text before the fence)`` for every fenced block of a Markdown text."""
    lines = text.splitlines()
    i, before = 0, 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            j += 1
        yield i + 1, opening["info"].lower(), "\n".join(body) + "\n", "\n".join(lines[before:i])
        i = before = j + 1


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, each with its skip marker if it has one."""
    found: list[Block] = []
    for line, info, body, before in fenced(path.read_text()):
        if info not in ("python", "py"):
            continue
        # The marker counts only when nothing but blank lines separates it from the fence.
        tail = before.rstrip().rsplit("\n", 1)[-1].strip()
        marker = _SKIP.fullmatch(tail)
        skip = (marker["reason"].strip() if marker["colon"] else "") if marker else None
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        found.append(Block(name, len(found), line, body, skip))
    return found


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# -- the locations the docs use, and the fixtures for what they elide ---------------------------


@dataclass(frozen=True)
class Ctx:
    """One block's run: its own directory and its own bucket (``run``: which run of a block
    :data:`LAUNCHED` runs more than once, from 0)."""

    tmp: Path
    bucket: str
    run: int = 0

    @property
    def hot(self) -> str:
        return str(self.tmp / "nvme" / "run1")

    @property
    def cold(self) -> str:
        return f"s3://{self.bucket}/run1"


LOCATIONS: dict[str, Callable[[Ctx], str]] = {
    "/nvme/run1": lambda ctx: ctx.hot,
    "/local_nvme/run1": lambda ctx: str(ctx.tmp / "local_nvme" / "run1"),
    "s3://bucket/run1": lambda ctx: ctx.cold,
}


def localize(source: str, ctx: Ctx) -> str:
    """The block with the docs' example locations pointed at this run's directory and bucket."""
    for example, here in LOCATIONS.items():
        # Written any other way it would reach the real /nvme (tests may run as root): refuse.
        other = re.search(rf'(?<![\w"]){re.escape(example)}|{re.escape(example)}(?![\w"])', source)
        assert other is None, f"{example} appears in a form other than a double-quoted literal"
        source = source.replace(f'"{example}"', repr(here(ctx)))
    return source


def _training(ctx: Ctx) -> dict[str, Any]:
    """A tiny model, optimizer, scheduler and data: what a training script has built by then."""
    import torch

    from tierstore import ResumableLoader, ResumableSampler

    torch.manual_seed(0)
    dataset = [torch.randn(4) for _ in range(32)]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    loader = ResumableLoader(dataset, batch_size=8, sampler=ResumableSampler(len(dataset), seed=0))
    batches = loader.endless()

    def train_one_step() -> None:
        loss_fn(model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    # 500 steps: the blocks save every 500, so the loop ends with one real save.
    return {
        "dataset": dataset,
        "model": model,
        "optimizer": optimizer,
        "optim": optimizer,
        "scheduler": scheduler,
        "loader": loader,
        "loss_fn": loss_fn,
        "train_one_step": train_one_step,
        "total_steps": 500,
        "total": 500,
    }


def loss_fn(model: Any, batch: Any) -> Any:
    return model(batch).pow(2).mean()


def fixed_batch() -> Any:
    import torch

    return torch.linspace(-1.0, 1.0, 32).reshape(8, 4)


def _tensors(ctx: Ctx) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierstore import TieredWriter

    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    return {
        "dist": dist,
        "dcp": dcp,
        "TieredWriter": TieredWriter,
        "state": state,
        "step": 7,
        "hot": ctx.hot,
        "cold": ctx.cold,
        "ckpt_group": dist.new_group(backend="gloo"),
    }


def _committed(ctx: Ctx, *, cold: bool) -> dict[str, Any]:
    """A checkpoint committed in the hot tier (and migrated when ``cold``), and its writer."""
    ns = _tensors(ctx)
    writer = ns["TieredWriter"](ctx.hot, ctx.cold if cold else None, step=ns["step"])
    ns["dcp"].save(ns["state"], storage_writer=writer, process_group=ns["ckpt_group"])
    if cold:
        assert writer.migrator is not None and writer.migrator.wait(timeout=120)
    return {**ns, "writer": writer}


def _node_replaced(ctx: Ctx) -> dict[str, Any]:
    ns = _committed(ctx, cold=True)
    shutil.rmtree(ctx.hot)  # the new node's disk is empty: restore copies it back
    return ns


def _trained(ctx: Ctx) -> dict[str, Any]:
    """A manager that saved a ``TrainingState`` at step 7; the live state has moved on since."""
    from tierstore import CheckpointManager, TrainingState

    ns = _training(ctx)
    state = {"train": TrainingState(ns["model"], ns["optim"], ns["scheduler"], sampler=ns["loader"])}
    manager = CheckpointManager(ctx.hot, save_every=1)
    state["train"].step = 7
    manager.save(7, state)
    manager.wait()
    state["train"].step = 0
    return {**ns, "manager": manager, "state": state, "step": 8}


def _probed(ctx: Ctx) -> dict[str, Any]:
    return {**_trained(ctx), "fixed_batch": fixed_batch, "make_training_state": make_training_state}


def make_training_state() -> Any:
    """What the probe's ``build`` makes in a fresh process: the objects of :func:`_training`."""
    from tierstore import TrainingState

    ns = _training(Ctx(Path("."), ""))
    return TrainingState(ns["model"], ns["optim"], ns["scheduler"], sampler=ns["loader"])


def _cadence(ctx: Ctx) -> dict[str, Any]:
    from tierstore import CheckpointManager

    return {"CheckpointManager": CheckpointManager, "hot": ctx.hot, "cold": ctx.cold}


def _preempted_at_7(ctx: Ctx) -> dict[str, Any]:
    """The loop's names; its 7th training step gets a SIGTERM, as a preempted job would."""
    import os
    import signal

    import torch

    from tierstore import CheckpointManager

    steps = iter(range(1, 10**6))

    def train_step() -> None:
        if next(steps) == 7:
            os.kill(os.getpid(), signal.SIGTERM)

    return {
        "CheckpointManager": CheckpointManager,
        "state": {"w": torch.arange(16.0)},
        "total": 10**6,
        "train_step": train_step,
    }


def _plugin(ctx: Ctx) -> dict[str, Any]:
    # The plugin the block imports is the example one (examples/plugin/), as its text says.
    plugin = str(ROOT / "examples" / "plugin")
    if plugin not in sys.path:
        sys.path.insert(0, plugin)
    return {}


def _check_checkpoint(step: int, *, cold: bool) -> Callable[[dict[str, Any], Ctx], None]:
    def check(ns: dict[str, Any], ctx: Ctx) -> None:
        from tierstore import list_checkpoints

        assert [c.step for c in list_checkpoints(ctx.hot)] == [step]
        if cold:
            assert [c.step for c in list_checkpoints(Store(cold=ctx.cold))] == [step]

    return check


def _check_loaded(ns: dict[str, Any], ctx: Ctx) -> None:
    assert ns["state"]["train"].step == 7, "the load did not restore the saved step"


def _check_restored(ns: dict[str, Any], ctx: Ctx) -> None:
    assert ns["manifest"].step == 7 and _check_checkpoint(7, cold=True)(ns, ctx) is None


def _check_migrated(ns: dict[str, Any], ctx: Ctx) -> None:
    assert [r.state.value for r in ns["results"]] == ["committed"], ns["results"]
    _check_checkpoint(7, cold=True)(ns, ctx)


def _check_plugin(ns: dict[str, Any], ctx: Ctx) -> None:
    from tierstore.testing import BackendContract

    assert issubclass(ns["TestFlatDir"], BackendContract)


def _check_best(ns: dict[str, Any], ctx: Ctx) -> None:
    from tierstore import list_checkpoints

    kept = [(c.step, c.metrics) for c in list_checkpoints(ctx.hot)]
    assert kept == [(2, {"val_loss": 0.41}), (3, {"val_loss": 0.55}), (5, {"val_loss": 0.7})], kept


def _check_report(ns: dict[str, Any], ctx: Ctx) -> None:
    assert ns["report"].ok and ns["report"].keys_checked > 0


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors bit for bit (dtype included), through dicts and lists."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _cloned(value: Any) -> Any:
    """A deep copy of a state, each tensor (a DTensor: its local shard) cloned."""
    import torch

    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cloned(v) for v in value]
    return value


# -- docs/integrations.md: the blocks that run in processes of their own (LAUNCHED) --------------

LIGHTNING_STEPS_PER_EPOCH = 2  # per rank: Lightning gives each rank its half of the data


def _lightning(ctx: Ctx) -> dict[str, Any]:
    """A tiny LightningModule, sharded by FSDP2 (``ModelParallelStrategy`` runs it on CPU) and
    logging ``val_loss`` at every validation, and a datamodule. Each run of the block starts
    from other weights (seeded by the run), so a resume that restored nothing would show."""
    import lightning as L
    import torch
    from torch.distributed.fsdp import fully_shard

    class TinyRegressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
            self.val_losses: list[tuple[int, float]] = []  # (global step, val_loss) per epoch

        def configure_model(self) -> None:
            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def on_validation_epoch_end(self) -> None:
            if not self.trainer.sanity_checking:
                self.val_losses.append((self.global_step, float(self.trainer.callback_metrics["val_loss"])))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class TinyData(L.LightningDataModule):
        def setup(self, stage: str) -> None:
            data = torch.Generator().manual_seed(1)
            n = 2 * 8 * LIGHTNING_STEPS_PER_EPOCH  # 2 ranks x batch 8
            self.train = torch.utils.data.TensorDataset(
                torch.randn(n, 8, generator=data), torch.randn(n, 1, generator=data)
            )
            self.val = torch.utils.data.TensorDataset(
                torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
            )

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.train, batch_size=8)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.val, batch_size=8)

    torch.manual_seed(ctx.run)
    return {"model": TinyRegressor(), "datamodule": TinyData()}


_FITTED: dict[str, Any] = {}  # the first run's outcome, in this rank's process


def _lightning_state(ns: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards of the weights and of Adam's state, in parameter order."""
    model, optimizer = ns["model"], ns["trainer"].optimizers[0]
    return _cloned(
        {
            "model": dict(model.state_dict()),
            "adam": [optimizer.state[p] for p in model.parameters()],
            "step": ns["trainer"].global_step,
        }
    )


def _check_lightning(ns: dict[str, Any], ctx: Ctx) -> None:
    """Run 0 trains 3 epochs from scratch (``ckpt_path="last"`` finds nothing): each tier keeps
    the two lowest ``val_loss`` checkpoints and the last one, with their metric. Run 1 (the
    same script again, other initial weights) resumes from the newest checkpoint: nothing is
    left to train, and the weights and Adam state are the first run's, bit for bit."""
    import torch.distributed as dist

    from tierstore import list_checkpoints

    dist.barrier()  # every rank's fit ended: rank 0's closing prune included
    state = _lightning_state(ns)
    if ctx.run == 0:
        losses = dict(ns["model"].val_losses)
        last = 3 * LIGHTNING_STEPS_PER_EPOCH
        assert state["step"] == last and sorted(losses) == [LIGHTNING_STEPS_PER_EPOCH * e for e in (1, 2, 3)]
        best = sorted(losses, key=losses.__getitem__)[:2]
        expected = [(step, losses[step]) for step in sorted({*best, last})]
        for tier in (ctx.hot, Store(cold=ctx.cold)):
            kept = [(c.step, c.metrics["val_loss"]) for c in list_checkpoints(tier)]
            assert [s for s, _ in kept] == [s for s, _ in expected], (tier, kept, losses)
            assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(kept, expected)), (kept, expected)
        _FITTED.update(state=state, kept=[c.step for c in list_checkpoints(ctx.hot)])
        return
    assert ns["model"].val_losses == [], "the resumed fit trained again"
    assert _same(state, _FITTED["state"]), "the resumed weights or Adam state differ from the saved"
    assert [c.step for c in list_checkpoints(ctx.hot)] == _FITTED["kept"]


def _titan(ctx: Ctx) -> dict[str, Any]:
    """torchtitan's ``Trainer.Config`` as far as the block and the trainer's checkpointer use
    it: ``checkpoint`` (torchtitan's own ``CheckpointManager.Config`` until the block sets it)
    and ``dump_folder``, the ``base_folder`` the trainer builds the checkpointer with. The real
    one cannot be built here: ``torchtitan.trainer`` imports torchdata (its data loaders),
    which the checkpointer does not need. The process group is the trainer's, made first."""
    import dataclasses

    import torch.distributed as dist
    from torchtitan.components.checkpointer import CheckpointManager

    @dataclasses.dataclass
    class TrainerConfig:
        dump_folder: str
        checkpoint: Any = dataclasses.field(default_factory=CheckpointManager.Config)

    dist.init_process_group("gloo")
    return {"config": TrainerConfig(dump_folder=str(ctx.tmp / "outputs"))}


def _titan_run(config: Any, seed: int, save_at: int | None) -> dict[str, Any]:
    """What torchtitan's trainer does with ``config.checkpoint``: build the manager with
    ``.build(...)`` over a small model and torchtitan's optimizer and LR-scheduler containers,
    then ``load()``, or one training step and ``save(save_at)``; ``close()``. The state then."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    class TrainState:
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": torch.tensor(self.step)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step = int(state["step"])

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    train_state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )
    try:
        if save_at is None:
            assert checkpointer.load(), "load() found no checkpoint"
        else:
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizers.step()
            schedulers.step()
            train_state.step = save_at
            checkpointer.save(save_at)
            checkpointer.maybe_wait_for_saving()
    finally:
        checkpointer.close()
    return _cloned({"model": model.state_dict(), "optim": optimizers.state_dict(), "step": train_state.step})


def _check_titan(ns: dict[str, Any], ctx: Ctx) -> None:
    """The manager built from the block's config saves its interval's step, committed in the
    checkpoint folder under the dump folder (the hot tier) and in ``cold``; a fresh one, from
    other weights, loads it back: model, optimizer and step equal the saved ones."""
    from tierstore import list_checkpoints
    from tierstore.integrations.torchtitan import TieredCheckpointManager

    config = ns["config"]
    assert isinstance(config.checkpoint, TieredCheckpointManager.Config)
    step = config.checkpoint.interval
    saved = _titan_run(config, seed=0, save_at=step)
    hot = os.path.join(config.dump_folder, config.checkpoint.folder)
    assert [(c.name, c.step) for c in list_checkpoints(hot)] == [(f"step-{step}", step)]
    assert [c.step for c in list_checkpoints(Store(cold=ctx.cold))] == [step]
    loaded = _titan_run(config, seed=1, save_at=None)
    assert loaded["step"] == step and _same(loaded, saved), "the loaded state differs from the saved"


def _tc_model(ctx: Ctx) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 2)}


def _check_tc(ns: dict[str, Any], ctx: Ctx) -> None:
    """The block's load returned the saved step; the checkpoint is committed in both tiers;
    with the hot tier gone, a fresh manager loads the model's state from cold, bit for bit."""
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from tierstore import list_checkpoints
    from tierstore.integrations.torch_checkpointing import TieredStorageConfig

    assert ns["loaded"]["step"] == 100, ns["loaded"]
    for tier in (ctx.hot, Store(cold=ctx.cold)):
        assert [(c.name, c.step) for c in list_checkpoints(tier)] == [("step_100", 100)], tier
    shutil.rmtree(ctx.hot)
    saved = _cloned(dict(ns["model"].state_dict()))
    manager = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=TieredStorageConfig(hot=ctx.hot, cold=ctx.cold)
    ).build()
    try:
        into = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
        loaded = manager.load(f"{ctx.hot}/step_100", into=into)
    finally:
        manager.close()
    assert _same(dict(loaded["model"]), saved), "the checkpoint in cold is not the saved state"


# -- docs/first-week.md: the page walked in order, as a reader follows it ---------------------------

FIRST_WEEK = ROOT / "docs" / "first-week.md"
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LOSS = re.compile(r"^step (\d+): loss (\S+)$", re.M)


def _offline(ctx: Ctx) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to fetch
    return {}


def _check_first_week_script(ns: dict[str, Any], ctx: Ctx) -> None:
    """Run once, uninterrupted: every 5th step saved, ``keep_last(2)`` hot, ``keep_last(3)`` cold."""
    from tierstore import list_checkpoints

    assert ns["start"] == 0 and ns["step"] == 20
    assert [c.step for c in list_checkpoints(ctx.hot)] == [15, 20]
    assert [c.step for c in list_checkpoints(Store(cold=ctx.cold))] == [10, 15, 20]
    assert (ctx.tmp / "gpt2-config" / "config.json").is_file()


def _bash(script: str, cwd: Path, env: dict[str, str]) -> str:
    import subprocess

    proc = subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{script}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _first_week(ctx: Ctx) -> dict[str, Any]:
    """Everything docs/first-week.md does before its last block: its script saved as
    ``train.py``, each shell block after the script run by bash here (the install before it is
    ``make venv``, which ``make test`` ran), with a user's environment (no torchrun variables;
    the venv's ``python`` and ``tierstore`` first on PATH). Beside it the same script runs
    uninterrupted, into tiers of its own: the preempted and the resumed runs must print its
    losses, step for step. The export's words the page quotes are checked here too."""
    _offline(ctx)
    script = python_blocks(FIRST_WEEK)[0].source
    (ctx.tmp / "train.py").write_text(localize(script, ctx))
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    shell = [body for _, info, body, _ in fenced(FIRST_WEEK.read_text()) if info in ("sh", "bash")][1:]
    out = [
        _bash(body.replace("/nvme/run1", ctx.hot).replace("s3://bucket/run1", ctx.cold), ctx.tmp, env)
        for body in shell
    ]

    runs, _, exported = out
    assert "preempted: step 6 saved" in runs and "training from step 7" in runs, runs
    straight = ctx.tmp / "straight"
    straight.mkdir()
    (straight / "train.py").write_text(
        script.replace('"/nvme/run1"', repr(str(straight / "nvme"))).replace(
            '"s3://bucket/run1"', repr(f"s3://{ctx.bucket}/straight")
        )
    )
    uninterrupted = dict(_LOSS.findall(_bash("python train.py", straight, env)))
    assert sorted(map(int, uninterrupted)) == list(range(1, 21)), uninterrupted
    assert dict(_LOSS.findall(runs)) == {s: loss for s, loss in uninterrupted.items() if s != "6"}, (
        runs,
        uninterrupted,
    )
    for said in (
        "exported the model's weights, under train.model.",
        "left out 103 keys not under train.model.",
        "left out lm_head.weight: tied to transformer.wte.weight",
        "exported step-0000000020 (step 20) as safetensors",
    ):
        assert said in exported, exported
    return {}


def _check_first_week_loaded(ns: dict[str, Any], ctx: Ctx) -> None:
    """``from_pretrained`` found every weight where it belongs (the tied head tied again), and
    they are step 20's, as the checkpoint holds them."""
    import torch

    import tierstore

    info, model = ns["info"], ns["model"]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    tierstore.export(ctx.hot, format="torch", out=ctx.tmp / "saved", strip_prefix="train.model.", step=20)
    saved = torch.load(ctx.tmp / "saved" / "state_dict.pt", weights_only=True)
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())


Setup = Callable[[Ctx], dict[str, Any]]
Check = Callable[[dict[str, Any], Ctx], None]

# (file, index among its Python blocks) -> (the block's first line, setup, check after it runs).
# The first line guards the index: a block added above another one fails loudly, not silently.
SETUPS: dict[tuple[str, int], tuple[str, Setup | None, Check | None]] = {
    ("README.md", 0): (
        "from tierstore import CheckpointManager, Retention, TrainingState, keep_every, keep_last",
        _training,
        _check_checkpoint(500, cold=True),
    ),
    ("README.md", 1): ("import torch.distributed as dist", _tensors, _check_checkpoint(1200, cold=False)),
    ("docs/index.md", 2): ("from tierstore import Store, TieredWriter, list_checkpoints, prune", None, None),
    ("docs/index.md", 5): (
        'ckpt_group = dist.new_group(backend="gloo")',
        _tensors,
        _check_checkpoint(7, cold=False),
    ),
    ("docs/integrations.md", 0): ("import lightning as L", _lightning, _check_lightning),
    ("docs/integrations.md", 1): (
        "from tierstore.integrations.torchtitan import TieredCheckpointManager",
        _titan,
        _check_titan,
    ),
    ("docs/integrations.md", 2): ("from torch_checkpointing import CheckpointManager", _tc_model, _check_tc),
    ("docs/migration.md", 0): (
        'writer = TieredWriter(hot="/nvme/run1", cold="s3://bucket/run1", step=step)',
        _tensors,
        _check_checkpoint(7, cold=False),
    ),
    ("docs/migration.md", 1): (
        "from tierstore import Store, migrate_pending",
        lambda ctx: _committed(ctx, cold=False),
        _check_migrated,
    ),
    ("docs/migration.md", 2): (
        "writer.migrator.status()     # [MigrationStatus(name, attempt, step, state, rank, bytes_total,",
        lambda ctx: _committed(ctx, cold=True),
        None,
    ),
    ("docs/migration.md", 3): (
        "from tierstore import Store, migration_status",
        lambda ctx: _committed(ctx, cold=True),
        None,
    ),
    ("docs/migration.md", 5): ("from tierstore import Store, restore", _node_replaced, _check_restored),
    ("docs/operations.md", 2): ("import torch", None, _check_best),
    ("docs/plugins.md", 0): ("import pytest", _plugin, _check_plugin),
    ("docs/training-state.md", 0): (
        "from tierstore import CheckpointManager, ResumableLoader, ResumableSampler, TrainingState",
        _training,
        _check_checkpoint(500, cold=True),
    ),
    ("docs/training-state.md", 1): ("from tierstore import ResumePlanner", _trained, _check_loaded),
    ("docs/training-state.md", 2): ("from tierstore import Probe", _probed, _check_report),
    ("docs/training-state.md", 3): (
        "from tierstore.resume.cadence import TimeCadence, optimal_interval",
        _cadence,
        None,
    ),
    ("docs/training-state.md", 4): (
        'manager = CheckpointManager("/nvme/run1", "s3://bucket/run1", save_every=500)',
        _preempted_at_7,
        _check_checkpoint(7, cold=True),
    ),
    ("docs/first-week.md", 0): ("import os", _offline, _check_first_week_script),
    ("docs/first-week.md", 1): ("import torch", _first_week, _check_first_week_loaded),
}


@dataclass(frozen=True)
class Launch:
    """How a block runs in processes of its own: on ``ranks`` ranks of a tests/launch.py job,
    ``runs`` times in each (each run a fresh namespace and ``__main__`` module, setup and
    check; a second run is a relaunched job's script), within ``timeout`` seconds."""

    ranks: int = 1
    runs: int = 1
    timeout: float = 240.0


# The blocks that do not run in the worker, and why:
LAUNCHED: dict[tuple[str, int], Launch] = {
    # Lightning's ModelParallelStrategy on 2 ranks (gloo), as tests/integrations/test_lightning.py
    # runs it; run twice: the second fit's ckpt_path="last" resumes from the first's checkpoints.
    ("docs/integrations.md", 0): Launch(ranks=2, runs=2, timeout=300.0),
    # torchtitan's manager installs a SIGTERM handler and keeps process groups: not in the worker.
    ("docs/integrations.md", 1): Launch(),
    # A __main__ guard, and torch_checkpointing's writer process, spawned from the script.
    ("docs/integrations.md", 2): Launch(),
    # The whole page walked first (_first_week): seven fresh interpreters, past the worker's 180 s.
    ("docs/first-week.md", 1): Launch(timeout=600.0),
}


def __getattr__(name: str) -> Any:
    """``probe``: the doc's own probe function, compiled from its text on first use.

    ``verify_resume`` starts fresh processes that import the probe by name. The block that
    defines it runs under this module's name, and a fresh process importing
    ``docs_fixtures:probe`` gets the same ``def`` compiled from the same text: the doc's
    probe runs there, not a stand-in.
    """
    if name != "probe":
        raise AttributeError(name)
    block = next(b for b in python_blocks(ROOT / "docs" / "training-state.md") if "def probe" in b.source)
    tree = ast.parse(block.source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ImportFrom)]
    exec(compile(tree, f"{block.file}:{block.line}", "exec"), globals())
    return globals()["probe"]


# -- the worker --------------------------------------------------------------------------------


def run_block(request: dict[str, Any]) -> dict[str, Any]:
    """Run one block in a fresh namespace and directory; ``{"ok": ..., "error": traceback}``."""
    ctx = Ctx(Path(request["tmp"]), request["bucket"])
    setup, check = SETUPS.get((request["file"], request["index"]), ("", None, None))[1:]
    os.chdir(ctx.tmp)
    # The block's functions belong to this module, so a fresh process can import them by name.
    ns: dict[str, Any] = {"__name__": "docs_fixtures"}
    try:
        if setup is not None:
            ns.update(setup(ctx))
        exec(compile(localize(request["source"], ctx), request["name"], "exec"), ns)
        if check is not None:
            check(ns, ctx)
        return {"ok": True}
    except BaseException:  # DCP's CheckpointException is a BaseException
        return {"ok": False, "error": traceback.format_exc()}
    finally:
        _tear_down(ns, ctx)


def run_as_main(request: dict[str, Any]) -> None:
    """One rank's runs of a block :data:`LAUNCHED` (tests/docs_job.py calls it): the block's
    text from ``request["script"]`` (localized by the test) runs as this interpreter's
    ``__main__`` module, whose ``__file__`` is that script, so ``__name__ == "__main__"``
    holds and a process spawned from it re-imports the block, not this runner. Raises what
    the setup, the block or the check raised."""
    key = (request["file"], request["index"])
    setup, check = SETUPS.get(key, ("", None, None))[1:]
    script = Path(request["script"])
    code = compile(script.read_text(), request["name"], "exec")
    runner = sys.modules["__main__"]
    os.chdir(request["tmp"])
    try:
        for run in range(request["runs"]):
            ctx = Ctx(Path(request["tmp"]), request["bucket"], run)
            module = types.ModuleType("__main__")
            module.__file__ = str(script)
            sys.modules["__main__"] = module
            ns = module.__dict__
            if setup is not None:
                ns.update(setup(ctx))
            exec(code, ns)
            if check is not None:
                check(ns, ctx)
    finally:
        sys.modules["__main__"] = runner


def _tear_down(ns: dict[str, Any], ctx: Ctx) -> None:
    """Close what the block left open, so the next block starts from a quiet process."""
    from tierstore import CheckpointManager
    from tierstore.migration.workers import drain

    for value in list(ns.values()):
        if isinstance(value, CheckpointManager):
            try:
                value.close(timeout=120)
            except BaseException:  # the block's own outcome is what is reported
                traceback.print_exc()
    drain(timeout=120)  # this process's migrators: a block's upload must not outlive it


def main() -> None:
    import torch.distributed as dist

    results = os.fdopen(os.dup(1), "w")  # blocks may print: their output goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    dist.init_process_group("gloo")
    for line in sys.stdin:
        print(json.dumps(run_block(json.loads(line))), file=results, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
