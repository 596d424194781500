"""A CheckpointManager never reports success while nothing is saved.

Failed background saves are raised by the next ``save()`` (or ``wait()``/``close()``), once;
``health()`` shows saves, migrations and pruning; a misconfigured tier fails when the manager
is built. Single process (DCP runs without a process group).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tierstore import CheckpointManager, StagingOptions, list_checkpoints
from tierstore.errors import BackendNotFound, CheckpointExists, MigrationFailed, NoSpaceLeft, SaveFailed
from tierstore.migration.migrator import MigrationOptions
from tierstore.options import ManagerOptions
from tierstore.retry import RetryPolicy
from tierstore.storage import faults

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=2,
    retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.01),
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state() -> dict:
    return {"w": torch.arange(64.0)}


@pytest.fixture(autouse=True)
def _no_faults() -> None:
    yield
    faults.disarm()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_is_raised_by_the_next_save_once(tmp_path: Path, async_save: bool) -> None:
    manager = CheckpointManager(
        str(tmp_path / "hot"), save_every=1, staging=StagingOptions(async_save=async_save)
    )
    assert manager.save(1, state())
    if async_save:
        # A name that already exists: the background save fails; nothing says so yet.
        assert manager.save(1, state(), force=True)
        # Raised by the next save, which saves its own step all the same.
        with pytest.raises(SaveFailed, match="step 1 failed.*already committed.*step 2 went ahead") as caught:
            manager.save(2, state())
    else:
        with pytest.raises(SaveFailed, match="step 1 failed.*already committed") as caught:
            manager.save(1, state(), force=True)
        assert manager.save(2, state())
    assert caught.value.step == 1
    assert isinstance(caught.value.errors[0], CheckpointExists)
    assert manager.save(3, state())  # raised once: the next save goes ahead quietly
    manager.close()
    health = manager.health()
    assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 1, 3)
    assert not health.ok and "already committed" in (health.last_error or "")
    assert [c.step for c in list_checkpoints(str(tmp_path / "hot"))] == [2, 3]  # keeps the last 2


def test_a_failed_last_save_is_raised_by_close(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "hot"), save_every=1)
    faults.arm("local.write", "enospc")  # the disk fills while the background save writes
    assert manager.save(1, state())
    with pytest.raises(SaveFailed, match="step 1 failed") as caught:
        manager.close()
    assert isinstance(caught.value.errors[0], NoSpaceLeft)
    assert manager.group is None  # released all the same
    assert list_checkpoints(str(tmp_path / "hot")) == []
    assert manager.health().saves_failed == 1


def test_wait_raises_a_failed_save(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "hot"), save_every=1)
    faults.arm("writer.before_manifest_publish", "raise")
    manager.save(1, state())
    with pytest.raises(SaveFailed, match="FaultInjected"):
        manager.wait()
    manager.wait()  # raised once
    manager.close()  # and not again at close
    assert list_checkpoints(str(tmp_path / "hot")) == []  # the failed save committed nothing
    health = manager.health()
    assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (0, 1, None)
    assert "FaultInjected" in (health.last_error or "")


def test_unknown_scheme_fails_when_the_manager_is_built(tmp_path: Path) -> None:
    with pytest.raises(BackendNotFound, match="'nosuch'"):
        CheckpointManager(str(tmp_path / "hot"), "nosuch://bucket/run")
    with pytest.raises(BackendNotFound, match="'nosuch'"):
        CheckpointManager("nosuch://bucket/run")


def test_failed_migrations_show_in_health_and_saves_still_commit(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cold tier's directory should be")
    hot = str(tmp_path / "hot")
    # close() spends close_timeout retrying a cold tier that refuses (invariant 26): 3 s
    # here, not the default 300 s, for a path a file blocks
    manager = CheckpointManager(
        hot, str(blocker / "cold"), save_every=1, migration=FAST, options=ManagerOptions(close_timeout=3)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2, 3):
            assert manager.save(step, state())
        with pytest.raises(MigrationFailed) as raised:  # the end of the run says so
            manager.close()
    assert raised.value.checkpoints == tuple(f"step-{s:010d}" for s in (1, 2, 3))
    assert "not-a-dir" in str(raised.value) and "tierstore migrate" in str(raised.value)
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3]  # every save committed hot
    health = manager.health()
    assert health.saves_ok == 3 and health.saves_failed == 0
    assert sorted(s.step for s in health.migrations_failed) == [1, 2, 3] and not health.ok
    assert all(s.error and "not-a-dir" in s.error for s in health.migrations_failed)
