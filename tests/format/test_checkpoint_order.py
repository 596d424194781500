"""The one order of checkpoints: a checkpoint without a step, then step 0, 1, ... .

``step or -1`` would rank step 0 with the checkpoints that have no step and let creation
time decide between them. Every store below commits step 0 *before* the checkpoint without
a step, under a name sorting after step 0's, so that key puts step 0 first whether creation
time or name breaks the tie: each test here fails with it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import save, state_for

from tierstore import CheckpointManager, Retention, StagingOptions, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.format.manifest import checkpoint_order
from tierstore.lifecycle.retention import keep_all
from tierstore.lifecycle.scrub import verify_store
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Store, Tier

NO_STEP = "zz-no-step"  # sorts after "step-...": a tie broken by name puts it after step 0 too
BIG, SMALL = (1024, 1024), (8, 8)  # 4 MiB and 256 B of floats


def save_no_step(hot: str) -> None:
    dcp.save(state_for(7, SMALL), storage_writer=TieredWriter(hot, name=NO_STEP))


def test_the_key_itself(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 0, shape=SMALL)
    save_no_step(hot)
    save(hot, 1, shape=SMALL)
    by_creation = sorted(Tier("hot", hot).manifests(), key=lambda m: m.created)
    assert [m.step for m in by_creation] == [0, None, 1]
    assert [m.step for m in sorted(by_creation, key=checkpoint_order)] == [None, 0, 1]


@pytest.fixture
def three(tmp_path: Path) -> str:
    """A hot tier holding step 0, then a checkpoint without a step, then step 1."""
    hot = str(tmp_path / "hot")
    save(hot, 0, shape=SMALL)
    save_no_step(hot)
    save(hot, 1, shape=SMALL)
    return hot


def test_list_checkpoints(three: str) -> None:
    assert [c.step for c in list_checkpoints(three)] == [None, 0, 1]


def test_scrub_output(three: str) -> None:
    order = list(dict.fromkeys(c.checkpoint for c in verify_store(three)))
    assert order == [NO_STEP, layout.default_name(0), layout.default_name(1)]


class TightBackend(LocalBackend):
    """A local tier reporting a fixed free space, so that the manager's watermark is tested
    against the sizes of real checkpoints."""

    scheme = "tight"

    def __init__(self, url: str, *, free: int, **options: Any) -> None:
        super().__init__(url.replace("tight://", "file://", 1), **options)
        self.free = free

    def free_bytes(self) -> int | None:
        return self.free


def test_disk_pressure_measures_the_newest_checkpoint(tmp_path: Path, registered_backend, caplog) -> None:
    """The "auto" watermark is 1.1x the newest checkpoint: step 0 (4 MiB), not the small
    checkpoint without a step committed after it. 3 MiB free is below that watermark, so
    the save prunes the hot tier down to its newest checkpoint, step 0."""
    registered_backend("tight", TightBackend)
    hot = str(tmp_path / "hot")
    save(hot, 0, shape=BIG)
    save_no_step(hot)
    with (
        caplog.at_level(logging.WARNING, logger="tierstore"),
        CheckpointManager(
            Store(f"tight://{hot}", hot_options={"free": 3 << 20}),
            retention=Retention(hot=keep_all()),
            staging=StagingOptions(async_save=False),
        ) as manager,
    ):
        assert manager.save(5, state_for(5, SMALL))
    assert "below its free-space watermark" in caplog.text
    assert [c.step for c in list_checkpoints(hot)] == [0, 5]
