"""TierstoreCheckpoint with the real lightning package: 2 CPU ranks (gloo), SIGKILL, resume.

Run as a script, this file is one rank of a Lightning job
(``python tests/integrations/test_lightning.py SPEC``, started by tests/launch.py like torchrun
would): a tiny seeded MLP trained with Adam under ``ModelParallelStrategy`` (FSDP2 shards; it
runs on CPU) or DDP, checkpointed at every epoch end through ``TierstoreCheckpoint``. Rank 0 may
SIGKILL itself in the middle of an epoch once the last save committed; rank 0 writes the final
full weights and optimizer state.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch

from tierstore import Store, list_checkpoints

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/: launch.py, when run as a rank
from launch import leave_cleanly, run_job  # noqa: E402

pytestmark = pytest.mark.dist

STEPS_PER_EPOCH = 2


def _job(spec: dict[str, Any]) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from tierstore.integrations.lightning import TierstoreCheckpoint

    sharded = spec["strategy"] == "model_parallel"

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def configure_model(self) -> None:
            if sharded:
                assert self.device_mesh is not None
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[2]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == spec.get("kill_at") and self.global_rank == 0:
                assert checkpoint.manager is not None
                checkpoint.manager.wait()  # the last epoch's save committed and migrated
                os.kill(os.getpid(), signal.SIGKILL)
            if self.global_step == spec.get("sigterm_at"):
                # Every rank, as Slurm and torchrun signal every task: Lightning's own handler
                # broadcasts inside the signal handler, which only pairs up if all ranks are in it.
                os.kill(os.getpid(), signal.SIGTERM)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            if "scores" in spec:  # a metric that is not monotonic, to rank checkpoints by
                score = torch.tensor(spec["scores"][self.current_epoch])
                self.log("score", score, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    data = torch.Generator().manual_seed(1)
    n = 2 * 4 * STEPS_PER_EPOCH  # 2 ranks x batch 4 x steps per epoch
    dataset = torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=data), torch.randn(n, 1, generator=data)
    )
    checkpoint = TierstoreCheckpoint(
        spec["hot"], spec["cold"], every_n_epochs=1, save_on_train_epoch_end=True, **spec.get("options", {})
    )
    # Both ranks data parallel: "auto" would make them one tensor-parallel group.
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if sharded
        else DDPStrategy(process_group_backend="gloo")
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=spec["epochs"],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["out"],
        deterministic=True,
    )
    model = Net()
    # Each rank its half, in order (Lightning adds no sampler under ModelParallelStrategy).
    sampler: torch.utils.data.Sampler[int] = torch.utils.data.DistributedSampler(
        dataset, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        trainer.fit(model, loader, ckpt_path=spec.get("ckpt_path"))
    except SIGTERMException:  # what Lightning raises on a SIGTERM, on every rank (exit 0)
        if trainer.global_rank == 0:
            Path(spec["out"], "preempted.json").write_text(json.dumps({"step": trainer.global_step}))
        if spec.get("exit_as_lightning_does"):
            raise  # through interpreter shutdown, as a user's script ends
        leave_cleanly()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    assert trainer.strategy.model is not None
    final = {
        "model": get_model_state_dict(trainer.strategy.model, options=options),
        "optim": get_optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], options=options),
        "resumed": checkpoint._restored_step,
        "step": trainer.global_step,
    }
    if trainer.global_rank == 0:
        torch.save(final, Path(spec["out"], "final.pt"))
    leave_cleanly()


def _run(tmp_path: Path, name: str, world: int = 2, **spec: Any) -> Any:
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    job = run_job({**spec, "out": str(out)}, world, script=Path(__file__), timeout=240)
    return job, out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("strategy", ["model_parallel", "ddp"])
def test_killed_run_resumes_from_last_and_matches_an_uninterrupted_run(tmp_path: Path, strategy: str) -> None:
    epochs = 4
    whole, whole_out = _run(
        tmp_path,
        "whole",
        strategy=strategy,
        epochs=epochs,
        hot=str(tmp_path / "whole-hot"),
        cold=str(tmp_path / "whole-cold"),
    )
    assert whole.ok, whole.describe()
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    # Killed in the third epoch, after the second epoch's checkpoint (step 4) committed.
    killed, _ = _run(
        tmp_path,
        "killed",
        strategy=strategy,
        epochs=epochs,
        hot=hot,
        cold=cold,
        kill_at=2 * STEPS_PER_EPOCH + 1,
    )
    assert killed.ranks[0].returncode == -signal.SIGKILL, killed.describe()
    # (the kill may beat the background prune of step 2)
    assert list_checkpoints(hot)[-1].step == 2 * STEPS_PER_EPOCH
    resumed, resumed_out = _run(
        tmp_path, "resumed", strategy=strategy, epochs=epochs, hot=hot, cold=cold, ckpt_path="last"
    )
    assert resumed.ok, resumed.describe()
    expected = torch.load(whole_out / "final.pt", weights_only=True)
    got = torch.load(resumed_out / "final.pt", weights_only=True)
    assert got["resumed"] == 2 * STEPS_PER_EPOCH and expected["resumed"] is None
    assert got["step"] == expected["step"] == epochs * STEPS_PER_EPOCH
    assert _same(got["model"], expected["model"]), "weights differ from the uninterrupted run"
    assert _same(got["optim"], expected["optim"]), "optimizer state differs"
    # save_top_k=1 without monitor keeps the newest; the trainer's end waited for migration.
    newest = epochs * STEPS_PER_EPOCH
    assert [c.step for c in list_checkpoints(hot)] == [newest]
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [newest]


def test_a_sigterm_mid_epoch_saves_that_step_to_both_tiers_and_fit_last_resumes_it(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    # In the first batch of epoch 3: Lightning stops at the next batch, step 5, mid-epoch
    # (the cadence saves at epoch ends only: steps 2, 4, 6, 8).
    at = 2 * STEPS_PER_EPOCH
    job, out = _run(
        tmp_path,
        "preempted",
        strategy="model_parallel",
        epochs=4,
        hot=hot,
        cold=cold,
        sigterm_at=at,
        exit_as_lightning_does=True,
    )
    assert job.ok, job.describe()  # both ranks exit 0, through interpreter shutdown
    for rank in job.ranks:  # and nothing of the manager runs after it began
        assert "Traceback" not in rank.output and "after interpreter shutdown" not in rank.output, rank.output
    stopped = json.loads((out / "preempted.json").read_text())["step"]
    assert stopped == at + 1 and stopped % STEPS_PER_EPOCH, job.describe()
    assert "preempted (SIGTERM): saved step" in job.ranks[0].output
    assert "committed in the cold tier" in job.ranks[0].output
    assert [c.step for c in list_checkpoints(hot)][-1] == stopped
    assert [c.step for c in list_checkpoints(Store(cold=cold))][-1] == stopped  # within the grace period
    resumed, resumed_out = _run(
        tmp_path, "resumed", strategy="model_parallel", epochs=4, hot=hot, cold=cold, ckpt_path="last"
    )
    assert resumed.ok, resumed.describe()
    final = torch.load(resumed_out / "final.pt", weights_only=True)
    assert final["resumed"] == stopped and final["step"] == 4 * STEPS_PER_EPOCH


def test_save_top_k_by_a_metric_keeps_the_best_and_last_and_resumes_a_chosen_step(tmp_path: Path) -> None:
    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    options = {"monitor": "score", "mode": "min", "save_top_k": 2, "save_last": True}
    scores = [0.5, 0.1, 0.3, 0.9]  # epoch ends at steps 2, 4, 6, 8
    job, _ = _run(
        tmp_path, "topk", strategy="ddp", epochs=4, hot=hot, cold=cold, options=options, scores=scores
    )
    assert job.ok, job.describe()
    # The 2 lowest scores (steps 4 and 6); step 2 was saved, then pruned; step 8 was not in
    # the top 2, so not saved (Lightning saves "last" only at a step it saved).
    for found in (list_checkpoints(hot), list_checkpoints(Store(cold=cold))):
        assert [c.step for c in found] == [4, 6]
        assert [c.metrics for c in found] == [{"score": pytest.approx(s)} for s in (0.1, 0.3)]
    job, out = _run(
        tmp_path,
        "chosen",
        strategy="ddp",
        epochs=3,
        hot=hot,
        cold=cold,
        options=options,
        scores=scores,
        ckpt_path=TierstoreCheckpoint.step_path(4),
    )
    assert job.ok, job.describe()
    final = torch.load(out / "final.pt", weights_only=True)
    assert final["resumed"] == 4 and final["step"] == 6
    # Step 6 of the first run is still there: committed checkpoints are never overwritten.
    assert "step 6 is already committed" in job.ranks[0].output
    assert [c.step for c in list_checkpoints(hot)] == [4, 6]


def _info(step: int, **metrics: float) -> Any:
    from tierstore.tiers.catalog import CheckpointInfo

    return CheckpointInfo(
        name=f"step-{step}",
        step=step,
        attempt="a",
        created=float(step),
        world_size=2,
        size=1,
        num_files=1,
        tiers=("hot",),
        metrics=metrics,
    )


def test_policy_keeps_what_model_checkpoint_keeps() -> None:
    from tierstore.integrations.lightning import policy_for

    found = [_info(2, loss=0.5), _info(4, loss=0.1), _info(6, loss=0.3), _info(8), _info(10, loss=0.9)]

    def kept(*args: Any) -> list[int]:
        return sorted(int(n.split("-")[1]) for n in policy_for(*args).keep(found, now=0.0))

    assert kept("loss", 2, "min", None) == [4, 6]  # a save without the metric is never best
    assert kept("loss", 2, "max", None) == [2, 10]
    assert kept("loss", 1, "min", True) == [4, 10]  # save_last: the newest too
    assert kept(None, 1, "min", False) == [10]
    assert kept(None, -1, "min", False) == [2, 4, 6, 8, 10]
    assert kept("loss", 0, "min", "link") == [10]


def test_a_manager_option_it_does_not_take_fails_when_the_callback_is_built(tmp_path: Path) -> None:
    from tierstore import StagingOptions
    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot = str(tmp_path / "hot")
    with pytest.raises(TypeError, match="'stagin', which CheckpointManager does not take"):
        TierstoreCheckpoint(hot, manager_options={"stagin": StagingOptions(async_save=False)})
    with pytest.raises(TypeError, match="'retention'.*retention is the callback's own argument"):
        TierstoreCheckpoint(hot, manager_options={"retention": None})
    for old, new in (("hot_policy", "retention=Retention"), ("hot_options", "CheckpointManager\\(Store\\(")):
        with pytest.raises(TypeError, match=f"'{old}', which CheckpointManager no longer takes: pass {new}"):
            TierstoreCheckpoint(hot, manager_options={old: None})
    callback = TierstoreCheckpoint(hot, manager_options={"staging": StagingOptions(async_save=False)})
    assert callback.manager_options == {"staging": StagingOptions(async_save=False)}


def test_retention_defaults_to_what_model_checkpoint_keeps_and_refuses_its_old_form(tmp_path: Path) -> None:
    from tierstore import Retention, keep_last
    from tierstore.errors import ConfigError
    from tierstore.integrations.lightning import TierstoreCheckpoint
    from tierstore.lifecycle.retention import keep_all

    hot = str(tmp_path / "hot")
    assert TierstoreCheckpoint(hot).retention == Retention(hot=keep_last(1), cold=keep_last(1))
    assert TierstoreCheckpoint(hot, save_top_k=-1).retention == Retention(hot=keep_all(), cold=keep_all())
    given = Retention(hot=keep_last(1), cold=keep_all(), hot_min_free=None)
    assert TierstoreCheckpoint(hot, retention=given).retention == given
    for old in ("hot_policy", "cold_policy"):
        with pytest.raises(TypeError, match=f"no longer takes {old}=: pass retention=Retention"):
            TierstoreCheckpoint(hot, save_top_k=-1, **{old: keep_last(1)})
    with pytest.raises(ConfigError, match="retention=\\) takes a Retention"):
        TierstoreCheckpoint(hot, retention=keep_last(1))


def test_refuses_strategies_that_hold_the_state_on_rank_0_only(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from tierstore.errors import ConfigError
    from tierstore.integrations.lightning import _check_strategy

    for strategy in (
        FSDPStrategy(state_dict_type="full"),
        ModelParallelStrategy(save_distributed_checkpoint=False),
    ):
        with pytest.raises(ConfigError, match="sharded state from every rank"):
            _check_strategy(strategy)
    _check_strategy(FSDPStrategy(state_dict_type="sharded"))


def test_a_step_the_store_lacks_raises_not_found_single_process(tmp_path: Path) -> None:
    import lightning as L

    from tierstore.errors import CheckpointNotFound
    from tierstore.integrations.lightning import TierstoreCheckpoint

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch[0]).sum()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
    callback = TierstoreCheckpoint(str(tmp_path / "hot"), every_n_train_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Net(), data)
    assert [c.step for c in list_checkpoints(str(tmp_path / "hot"))] == [4]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        callbacks=[TierstoreCheckpoint(str(tmp_path / "hot"))],
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(CheckpointNotFound, match="at step 3"):
        trainer.fit(Net(), data, ckpt_path=TierstoreCheckpoint.step_path(3))


def test_example_fits_resumes_from_last_and_keeps_the_two_best(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            str(HERE.parents[1] / "examples" / "lightning_tierstore.py"),
            "--workdir",
            str(tmp_path),
            "--epochs",
            "2",
            "--more",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "first fit: trained to step 8" in proc.stdout
    assert "resumed fit (ckpt_path='last'): trained to step 12" in proc.stdout
    assert "Restored all states from the checkpoint at" in proc.stdout + proc.stderr
    hot = list_checkpoints(str(tmp_path / "hot"))
    assert len(hot) == 2 and hot[-1].step == 12 and all("train_loss" in c.metrics for c in hot)
    assert [c.step for c in list_checkpoints(Store(cold=str(tmp_path / "cold")))] == [c.step for c in hot]


if __name__ == "__main__":
    _job(json.loads(sys.argv[1]))


def _tiny_fit(tmp_path: Path, max_steps: int, callback: Any, ckpt_path: str | None = None) -> Any:
    """One process, a 2-parameter model: what a path Lightning exposes leads to."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch[0]).sum()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Net(), data, ckpt_path=ckpt_path)
    return trainer, Net


def test_the_paths_lightning_exposes_resume_and_load_from_checkpoint_names_the_tierstore_call(
    tmp_path: Path,
) -> None:
    from tierstore.errors import ConfigError
    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot = str(tmp_path / "hot")
    callback = TierstoreCheckpoint(
        hot, every_n_train_steps=2, monitor="loss", save_top_k=2, mode="max", save_last=True
    )
    _tiny_fit(tmp_path, 6, callback)
    kept = [c.step for c in list_checkpoints(hot)]
    # Every path Lightning holds names a checkpoint the store commits.
    exposed = {callback.best_model_path, callback.last_model_path, *callback.best_k_models}
    assert exposed <= {TierstoreCheckpoint.step_path(s) for s in kept}, (exposed, kept)
    assert callback.last_model_path == TierstoreCheckpoint.step_path(6)
    assert len(callback.best_k_models) == 2
    for path in sorted(exposed):
        again = TierstoreCheckpoint(hot, save_top_k=-1)  # keeps all: the next path is still there
        trainer, net = _tiny_fit(tmp_path, 8, again, ckpt_path=path)
        assert again._restored_step == int(path.rsplit("=", 1)[1]) and trainer.global_step == 8
    # LightningModule.load_from_checkpoint goes through fsspec, not the strategy: it cannot
    # read a tierstore checkpoint, and says which calls do.
    with pytest.raises(
        ConfigError, match=r"TierstoreCheckpoint\.step_path\(N\).*ckpt_path|ckpt_path.*step_path"
    ):
        net.load_from_checkpoint(callback.best_model_path)


def test_model_checkpoint_arguments_it_ignores_are_named_when_built(tmp_path: Path) -> None:
    import warnings

    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot = str(tmp_path / "hot")
    for argument, value in (
        ("dirpath", str(tmp_path / "ckpts")),
        ("filename", "{epoch}-{loss:.2f}"),
        ("auto_insert_metric_name", False),
        ("enable_version_counter", False),
    ):
        with pytest.warns(UserWarning, match=rf"ignores ModelCheckpoint's {argument}=") as caught:
            TierstoreCheckpoint(hot, **{argument: value})
        assert len(caught) == 1, [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults, and every argument it honours: silent
        TierstoreCheckpoint(
            hot,
            dirpath=None,
            filename=None,
            monitor="loss",
            verbose=True,
            save_last=True,
            save_top_k=2,
            save_on_exception=True,
            save_weights_only=False,
            mode="max",
            auto_insert_metric_name=True,
            every_n_train_steps=2,
            save_on_train_epoch_end=False,
            enable_version_counter=True,
        )
