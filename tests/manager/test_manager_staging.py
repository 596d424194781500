"""CheckpointManager staging: buffers paid once, and save() returns only once the copy is taken.

Each checkpoint must hold the state as it was when ``save()`` was called, even though the
caller changes the state the moment ``save()`` returns. A slow object ahead of the tensors in
the state (:class:`SlowCopy`) holds the background copy back, so a manager that returned before
the copy was taken would save the changed values. Single process with THREAD mode; PROCESS
mode needs a process group, so it runs as a 1-rank job (this file is also its script).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import CheckpointManager, Retention, StagingOptions, WriterOptions, list_checkpoints
from tierstore.errors import ConfigError, SaveFailed
from tierstore.lifecycle.retention import keep_all

SHAPE = (128, 65)


class SlowCopy:
    """Staged (deep-copied) slowly, as a large tensor would be; saved as a plain int."""

    def __deepcopy__(self, memo: dict[int, Any]) -> int:
        time.sleep(0.3)  # long enough that a save() not waiting for the copy is caught
        return 0


class FailingCopy:
    def __deepcopy__(self, memo: dict[int, Any]) -> int:
        raise RuntimeError("cannot stage this")


def fill(state: dict[str, Any], value: float) -> None:
    state["w"].fill_(value)
    state["opt"]["m"].fill_(value * 10)


def new_state() -> dict[str, Any]:
    return {"gate": SlowCopy(), "w": torch.zeros(SHAPE), "opt": {"m": torch.zeros(7)}, "n": 0}


def tensor_bytes(state: dict[str, Any]) -> int:
    return int(state["w"].nbytes + state["opt"]["m"].nbytes)


def loaded(manager: CheckpointManager, step: int, shape: tuple[int, ...] = SHAPE) -> dict[str, Any]:
    target = {"w": torch.full(shape, -7.0), "opt": {"m": torch.full((7,), -7.0)}}
    assert manager.load(target, step=step) == step
    return target


def assert_holds(manager: CheckpointManager, step: int, shape: tuple[int, ...] = SHAPE) -> None:
    got = loaded(manager, step, shape)
    assert torch.equal(got["w"], torch.full(shape, float(step))), step
    assert torch.equal(got["opt"]["m"], torch.full((7,), step * 10.0)), step


def save_and_scribble(manager: CheckpointManager, state: dict[str, Any], step: int) -> None:
    """Save ``step``'s values, then change them the moment it is allowed: when save()
    returns, or with ``StagingOptions(overlap=True)`` when wait_staged() does."""
    fill(state, step)
    assert manager.save(step, state)
    if manager.staging.overlap:
        manager.wait_staged()
    fill(state, -1.0)


def goes_ahead_after_failed_step_2(manager: CheckpointManager, state: dict[str, Any], tmp_path: Path) -> None:
    """Step 1 saved, step 2 failed: step 3 saves, and only 1 and 3 are checkpoints."""
    save_and_scribble(manager, state, 3)
    manager.close()
    health = manager.health()
    assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (2, 1, 3)
    assert [c.step for c in list_checkpoints(str(tmp_path / "hot"))] == [1, 3]
    assert_holds(manager, 3)


def manager_for(tmp_path: Path, **options: Any) -> CheckpointManager:
    return CheckpointManager(
        str(tmp_path / "hot"), save_every=1, retention=Retention(hot=keep_all(), hot_min_free=None), **options
    )


def test_reused_buffers_and_each_checkpoint_holds_its_own_values(tmp_path: Path) -> None:
    manager, state = manager_for(tmp_path), new_state()
    for step in (1, 2, 3):
        save_and_scribble(manager, state, step)
    manager.close()
    # The first save allocated the staging buffers, the next two refilled them.
    assert manager.staging_allocated == {1: tensor_bytes(state), 2: 0, 3: 0}
    assert list(manager.stalls) == [1, 2, 3]
    for step in (1, 2, 3):
        assert_holds(manager, step)


def test_a_module_state_dict_rebuilt_each_save_reuses_the_buffers(tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 8)
    manager = manager_for(tmp_path)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        assert manager.save(step, {"model": model})  # DCP calls model.state_dict() each time
    manager.close()
    size = sum(p.nbytes for p in model.parameters())
    assert manager.staging_allocated == {1: size, 2: 0, 3: 0}
    target = torch.nn.Linear(16, 8)
    manager.load({"model": target}, step=2)
    assert torch.equal(target.weight, torch.full((8, 16), 2.0))


def test_a_structure_change_rebuilds_only_what_changed_and_saves_correctly(tmp_path: Path) -> None:
    manager, state = manager_for(tmp_path), new_state()
    save_and_scribble(manager, state, 1)
    state["extra"] = torch.arange(5.0)  # a new key
    save_and_scribble(manager, state, 2)
    state["w"] = torch.zeros(64, 3)  # a new shape
    save_and_scribble(manager, state, 3)
    save_and_scribble(manager, state, 4)
    manager.close()
    assert manager.staging_allocated == {1: tensor_bytes(new_state()), 2: 5 * 4, 3: 64 * 3 * 4, 4: 0}
    assert_holds(manager, 1)
    assert_holds(manager, 2)
    assert_holds(manager, 3, (64, 3))
    assert_holds(manager, 4, (64, 3))
    extra = {"extra": torch.zeros(5)}
    manager.load(extra, step=3)
    assert torch.equal(extra["extra"], torch.arange(5.0))


def test_fresh_staging_saves_the_same_and_keeps_no_buffers(tmp_path: Path) -> None:
    manager, state = manager_for(tmp_path, staging=StagingOptions(buffers="fresh")), new_state()
    for step in (1, 2):
        save_and_scribble(manager, state, step)
    manager.close()
    assert manager.staging_allocated == {} and list(manager.stalls) == [1, 2]
    for step in (1, 2):
        assert_holds(manager, step)


def test_overlapped_staging_is_safe_once_wait_staged_returns(tmp_path: Path) -> None:
    manager, state = manager_for(tmp_path, staging=StagingOptions(overlap=True)), new_state()
    for step in (1, 2):
        save_and_scribble(manager, state, step)
    fill(state, 3)
    manager.save(3, state)
    manager.close()  # waits for the copy too, before anything is released
    assert manager.staging_allocated == {1: tensor_bytes(state), 2: 0, 3: 0}
    for step in (1, 2, 3):
        assert_holds(manager, step)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_copy_is_raised_as_save_failed_and_the_next_save_goes_ahead(
    tmp_path: Path, overlap: bool
) -> None:
    manager, state = manager_for(tmp_path, staging=StagingOptions(overlap=overlap)), new_state()
    save_and_scribble(manager, state, 1)
    state["bad"] = FailingCopy()
    with pytest.raises(SaveFailed, match="step 2 failed.*cannot stage this") as caught:
        assert manager.save(2, state)  # with overlap, the copy fails in the background
        manager.wait_staged()
    assert isinstance(caught.value.errors[None], RuntimeError)
    del state["bad"]
    goes_ahead_after_failed_step_2(manager, state, tmp_path)


def test_staging_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="buffers must be"):
        StagingOptions(buffers="pinned")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="overlap needs"):
        StagingOptions(buffers="fresh", overlap=True)
    with pytest.raises(ConfigError, match="overlap needs"):
        StagingOptions(async_save=False, overlap=True)
    with pytest.raises(ConfigError, match="takes a StagingOptions"):
        manager_for(tmp_path, staging=WriterOptions())
    assert not (tmp_path / "hot").exists()


@pytest.mark.dist
def test_process_mode_reuses_shared_buffers_and_saves_each_steps_values(tmp_path: Path) -> None:
    from launch import run_job

    out = tmp_path / "result.json"
    job = run_job({"hot": str(tmp_path / "hot"), "out": str(out)}, 1, script=Path(__file__))
    assert job.ok, job.describe()
    result = json.loads(out.read_text())
    assert result["allocated"] == {"1": tensor_bytes(new_state()), "2": 0, "3": 0}
    assert result["loaded"] == {"1": [1.0, 10.0], "2": [2.0, 20.0], "3": [3.0, 30.0]}


def _process_job(spec: dict[str, Any]) -> None:
    """One rank: three PROCESS-mode saves, each scribbled over once save() returns."""
    import torch.distributed as dist
    from launch import leave_cleanly

    dist.init_process_group("gloo")
    manager = CheckpointManager(
        spec["hot"],
        save_every=1,
        retention=Retention(hot=keep_all(), hot_min_free=None),
        staging=StagingOptions(mode="process"),
    )
    state = new_state()
    for step in (1, 2, 3):
        save_and_scribble(manager, state, step)
    manager.close()
    values = {step: loaded(manager, step) for step in (1, 2, 3)}
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "allocated": manager.staging_allocated,
                "loaded": {
                    step: v["w"].unique().tolist() + v["opt"]["m"].unique().tolist()
                    for step, v in values.items()
                },
            }
        )
    )
    leave_cleanly()


if __name__ == "__main__":  # the PROCESS-mode job: run_job starts this file per rank
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: launch.py
    _process_job(json.loads(sys.argv[1]))


class Gate:
    """Staged only once the test lets it: proves save() returned while the copy waited."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waited_for_release = False

    def __deepcopy__(self, memo: dict[int, Any]) -> int:
        self.waited_for_release = self.release.wait(30)  # False: save() blocked on the copy
        return 0


def test_overlapped_save_returns_before_the_copy_is_taken(tmp_path: Path) -> None:
    manager, state = manager_for(tmp_path, staging=StagingOptions(overlap=True)), new_state()
    gate = state["gate"] = Gate()
    fill(state, 1)
    assert manager.save(1, state)
    gate.release.set()
    manager.wait_staged()
    assert gate.waited_for_release  # the copy was still waiting when save() had returned
    fill(state, -1.0)
    manager.close()
    assert_holds(manager, 1)


def test_an_error_on_the_managers_save_thread_fails_the_save_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore.manager.saving as manager_module

    def broken(*args: Any) -> None:
        raise RuntimeError("lost on the save thread")

    manager, state = manager_for(tmp_path, staging=StagingOptions(overlap=True)), new_state()
    monkeypatch.setattr(manager_module, "_chain", broken)
    assert manager.save(1, state)
    with pytest.raises(SaveFailed, match="lost on the save thread"):
        manager.wait_staged()
    monkeypatch.undo()
    save_and_scribble(manager, state, 2)
    manager.close()
    assert_holds(manager, 2)


class Counter:
    """A ``Stateful`` (DCP calls ``state_dict()`` when it saves): where and how often it is asked."""

    def __init__(self) -> None:
        self.value, self.asked_on = 0, []  # type: list[str]

    def state_dict(self) -> dict[str, Any]:
        self.asked_on.append(threading.current_thread().name)
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def test_the_default_save_copies_on_the_callers_thread_and_starts_dcp_on_the_managers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dcp.async_save logs every entry of the state and starts a thread before it copies: on
    # the caller's thread that is stall above the copy. Only the copy (and each Stateful's
    # state_dict(), which must see this step's state) may run there.
    import tierstore.manager.saving as saving

    started_on: list[str] = []
    real = saving.dcp_async_save

    def spy(*args: Any, **kwargs: Any) -> Any:
        started_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "dcp_async_save", spy)
    manager, state = manager_for(tmp_path), new_state()
    counter = state["counter"] = Counter()
    for step in (1, 2):
        counter.value = step
        save_and_scribble(manager, state, step)
        counter.value = -1  # changed the moment save() returned, as the tensors are
    manager.close()
    caller = threading.current_thread().name
    assert counter.asked_on == [caller, caller]
    assert len(started_on) == 2 and all(name.startswith("tierstore-save") for name in started_on)
    # The counter's state_dict() makes a new tensor every save: a new buffer (8 bytes) each time.
    assert manager.staging_allocated == {1: tensor_bytes(state) + 8, 2: 8}
    for step in (1, 2):
        assert_holds(manager, step)
        restored = Counter()
        assert manager.load({"counter": restored}, step=step) == step
        assert restored.value == step


def test_a_default_save_that_fails_on_the_managers_thread_is_raised_by_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore.manager.saving as saving

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planning refused this state")

    manager, state = manager_for(tmp_path), new_state()
    save_and_scribble(manager, state, 1)
    monkeypatch.setattr(saving, "dcp_async_save", refused)
    save_and_scribble(manager, state, 2)  # the copy is taken; DCP fails after save() returned
    with pytest.raises(SaveFailed, match="step 2 failed.*planning refused this state"):
        manager.wait(migrations=False)
    monkeypatch.undo()
    goes_ahead_after_failed_step_2(manager, state, tmp_path)
