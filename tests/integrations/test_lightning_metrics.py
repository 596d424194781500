"""TierstoreCheckpoint's record of a metric and of the last checkpoint (issue 38, item 4): a save
Lightning does not rank (the preemption save, save_on_exception's) records the monitored value
only if Lightning reported it at that step, never an earlier validation's; the paths a resumed
run holds (``last_model_path``, ``best_k_models``) name the newest checkpoints of the store.

Run as a script, this file is a one-process Lightning fit on CPU that validates every 2 steps
and SIGTERMs itself in a step between two validations (the preemption needs a process of its
own: the notice ends it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from test_lightning import _tiny_fit

from tierstore import list_checkpoints

HERE = Path(__file__).parent
VALIDATE_EVERY = 2  # training steps


def _fit(spec: dict[str, Any]) -> Any:
    """A 2-parameter model validated every VALIDATE_EVERY steps; ``raise_at``: its training step
    raises at that global step; ``sigterm_at``: the process SIGTERMs itself there."""
    import lightning as L

    from tierstore.integrations.lightning import TierstoreCheckpoint

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == spec.get("raise_at"):
                raise RuntimeError("a bug in the training step")
            if self.global_step == spec.get("sigterm_at"):
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning stops at the end of this batch
            loss: torch.Tensor = self.layer(batch[0]).sum()
            self.log("loss", loss)
            spec.setdefault("logged", {})[self.global_step + 1] = loss.item()  # by the step it makes
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            # a value of its own at each validation: 1000 + the step validated
            self.log("val_loss", self.layer(batch[0]).sum() * 0 + 1000.0 + self.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(16, 2)))
    callback = TierstoreCheckpoint(spec["hot"], **spec["options"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=spec.get("max_steps", 8),
        val_check_interval=VALIDATE_EVERY,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["root"],
    )
    trainer.fit(Net(), data, data)
    return callback


def _recorded(hot: str) -> dict[int, dict[str, float]]:
    return {int(c.step): dict(c.metrics) for c in list_checkpoints(hot) if c.step is not None}


def test_a_preemption_save_between_validations_records_no_earlier_validations_metric(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    spec = {
        "hot": hot,
        "root": str(tmp_path),
        "sigterm_at": 2,  # in the step after the validation at step 2: stopped at step 3
        "options": {"monitor": "val_loss", "save_top_k": 2},
    }
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = proc.stdout + proc.stderr
    assert "preempted (SIGTERM): saved step 3" in output, output[-3000:]
    # Step 2, saved at its validation's end, records that validation; step 3, the notice's,
    # none: what Lightning held was step 2's (it was recorded as step 3's, and ranked).
    assert _recorded(hot) == {2: {"val_loss": 1002.0}, 3: {}}, output[-3000:]


def test_a_save_on_an_exception_records_the_metric_of_its_step_or_none(tmp_path: Path) -> None:
    # The training step of step 3 raises: the save of step 3 (save_on_exception) comes after the
    # validation at step 2 and the training step of step 3 (the batch that made step 3).
    for monitor in ("val_loss", "loss"):
        hot = str(tmp_path / monitor)
        spec: dict[str, Any] = {"hot": hot, "root": str(tmp_path), "raise_at": 3}
        spec["options"] = {"monitor": monitor, "save_top_k": -1, "save_on_exception": True}
        with pytest.raises(RuntimeError, match="a bug in the training step"):
            _fit(spec)
        recorded = _recorded(hot)
        # val_loss: step 2's, held over; loss: logged by the training step that made step 3
        expected = {} if monitor == "val_loss" else {"loss": pytest.approx(spec["logged"][3])}
        assert recorded[3] == expected, (monitor, recorded)
    assert _recorded(str(tmp_path / "val_loss"))[2] == {"val_loss": 1002.0}
    # A save right after the validation of its own step records that validation.
    hot = str(tmp_path / "right-after")
    options = {"monitor": "val_loss", "save_top_k": -1, "save_on_exception": True}
    with pytest.raises(RuntimeError):
        _fit({"hot": hot, "root": str(tmp_path), "raise_at": 4, "options": options})
    assert _recorded(hot) == {2: {"val_loss": 1002.0}, 4: {"val_loss": 1004.0}}


def test_the_paths_a_run_resumed_from_its_final_checkpoint_holds_name_the_newest(tmp_path: Path) -> None:
    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot = str(tmp_path / "hot")
    options = {"every_n_train_steps": 2, "monitor": "loss", "save_top_k": 2, "mode": "min", "save_last": True}
    first = TierstoreCheckpoint(hot, **options)
    _tiny_fit(tmp_path, 6, first)  # the loss falls: each save is the best, then "last"
    assert first.last_model_path == TierstoreCheckpoint.step_path(6)
    for root in (tmp_path, tmp_path / "another-root"):  # Lightning's dirpath differs in the second
        again = TierstoreCheckpoint(hot, **options)
        trainer, _ = _tiny_fit(root, 6, again, ckpt_path="last")
        assert again._restored_step == 6 and trainer.global_step == 6
        assert again.last_model_path == TierstoreCheckpoint.step_path(6), root
        assert again.best_k_models.keys() == first.best_k_models.keys(), root
        assert again.best_model_path == first.best_model_path == TierstoreCheckpoint.step_path(6)


def test_save_last_link_names_the_newest_checkpoint_saved(tmp_path: Path) -> None:
    from tierstore.integrations.lightning import TierstoreCheckpoint

    hot = str(tmp_path / "hot")
    # mode="max" on a falling loss: only step 1 is ever in the top 1; "link" saves nothing more
    callback = TierstoreCheckpoint(
        hot, every_n_train_steps=1, monitor="loss", save_top_k=1, mode="max", save_last="link"
    )
    _tiny_fit(tmp_path, 3, callback)
    assert [c.step for c in list_checkpoints(hot)] == [1]
    assert callback.last_model_path == TierstoreCheckpoint.step_path(1)


if __name__ == "__main__":
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        _fit(json.loads(sys.argv[1]))
    except SIGTERMException:
        print("stopped by the preemption notice", flush=True)
