"""The save after a failed background save raises that failure and still saves its own step (issue
38, item 5): before, it raised and saved nothing, so a loop that caught SaveFailed and went on
lost every other step (in the full-disk and two-jobs trials, steps 2, 4 and 6 were never
attempted), and a disk that freed up was used only one save later."""

from __future__ import annotations

import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore import CheckpointManager, Retention, StagingOptions, list_checkpoints
from tierstore.errors import CheckpointExists, NoSpaceLeft, SaveFailed
from tierstore.lifecycle.retention import keep_all

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64.0) + step}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs, where this machine lets us mount one (root in a VM or CI)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_that_frees_up_saves_the_very_next_step(small_disk: Path) -> None:
    hot = str(small_disk / "run1")
    manager = CheckpointManager(hot, save_every=1, retention=Retention(hot=keep_all()), preemption=False)
    filler = small_disk / "someone-elses-file"
    filler.write_bytes(b"\0" * (3 << 20) + b"\0" * (512 << 10))  # 3.5 of 4 MiB: the disk is full
    assert manager.save(1, state(1))  # fails in the background: no room
    deadline = time.monotonic() + 60
    while manager.health().saves_failed == 0:  # health() raises nothing: the failure waits
        assert time.monotonic() < deadline, "the save of step 1 never failed"
        time.sleep(0.01)
    filler.unlink()  # the disk frees up
    with pytest.raises(SaveFailed, match="step 1 failed.*not enough free space.*step 2 went ahead") as raised:
        manager.save(2, state(2))
    assert raised.value.step == 1 and isinstance(raised.value.errors[0], NoSpaceLeft)
    assert manager.save(3, state(3))  # raised once
    manager.close()
    assert [c.step for c in list_checkpoints(hot)] == [2, 3]
    health = manager.health()
    assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (2, 1, 3)


def test_a_loop_that_catches_save_failed_attempts_every_step(tmp_path: Path) -> None:
    """Two jobs on one directory: each save of the second collides with the first's step.
    Every one is attempted, and each failure is raised once: save(n) raises step n-1's,
    close() the last."""
    hot = str(tmp_path / "hot")
    first = CheckpointManager(
        hot, save_every=1, retention=Retention(hot=keep_all()), preemption=False,
        staging=StagingOptions(async_save=False),
    )  # fmt: skip
    for step in range(1, 7):
        first.save(step, state(step))
    first.close()
    second = CheckpointManager(hot, save_every=1, retention=Retention(hot=keep_all()), preemption=False)
    raised: list[int | None] = []
    for step in range(1, 7):
        try:
            second.save(step, state(step))
        except SaveFailed as err:  # the loop logs it and trains on
            assert isinstance(err.errors[0], CheckpointExists)
            raised.append(err.step)
    with pytest.raises(SaveFailed) as last:
        second.close()
    assert raised + [last.value.step] == [1, 2, 3, 4, 5, 6]
    assert second.health().saves_failed == 6  # every step was attempted
