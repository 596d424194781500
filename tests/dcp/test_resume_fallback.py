"""Resuming survives a damaged newest checkpoint: it is skipped, with a warning naming what was
wrong, and the one before it loads. A named checkpoint is never swapped for another."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import blank, file_path, flip, matches, saved, unwrap
from launch import run_job
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import CheckpointManager, ReaderOptions, Retention, TieredReader
from tierstore.errors import CheckpointNotFound, ChecksumMismatch, ConfigError, InvalidManifest
from tierstore.format import layout

DAMAGES = {
    "metadata flipped": lambda root, m: flip(file_path(root, m, ".metadata")),
    "metadata missing": lambda root, m: file_path(root, m, ".metadata").unlink(),
    "shard truncated": lambda root, m: file_path(root, m, "__0_0.distcp").write_bytes(
        file_path(root, m, "__0_0.distcp").read_bytes()[:-7]
    ),
    "shard missing": lambda root, m: file_path(root, m, "__0_0.distcp").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_reader_without_name_skips_a_damaged_newest(hot_dir: str, damage: str, caplog) -> None:
    saved(hot_dir, 1)
    newest = saved(hot_dir, 2)
    DAMAGES[damage](hot_dir, newest)
    target = blank()
    reader = TieredReader(hot_dir, options=ReaderOptions(lease=False))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        dcp.load(target, storage_reader=reader)
    assert reader.manifest is not None and reader.manifest.step == 1
    assert matches(target, 1)
    warned = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and newest.name in warned[0] and "hot" in warned[0]
    file = ".metadata" if "metadata" in damage else "__0_0.distcp"
    assert file in warned[0]


def test_reader_with_a_name_never_falls_back(hot_dir: str) -> None:
    saved(hot_dir, 1)
    newest = saved(hot_dir, 2)
    flip(file_path(hot_dir, newest, ".metadata"))
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            blank(),
            storage_reader=TieredReader(hot_dir, name=newest.name, options=ReaderOptions(lease=False)),
        )
    err = unwrap(info.value)
    assert isinstance(err, ChecksumMismatch) and err.file == ".metadata"


def test_every_checkpoint_damaged_raises_the_newest_error(hot_dir: str) -> None:
    for step in (1, 2):
        file_path(hot_dir, saved(hot_dir, step), "__0_0.distcp").unlink()
    with pytest.raises(CheckpointException) as info:
        dcp.load(blank(), storage_reader=TieredReader(hot_dir, options=ReaderOptions(lease=False)))
    assert layout.default_name(2) in str(unwrap(info.value))


def test_invalid_manifest_in_one_tier_does_not_hide_the_valid_one(tmp_path: Path, caplog) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = saved(hot, 1)
    shutil.copytree(hot, cold)  # a local cold tier: the same layout, committed by its manifest
    key = Path(hot, layout.manifest_key(manifest.name))
    key.write_bytes(key.read_bytes()[:40])  # torn in hot only
    for name in (manifest.name, None):
        target = blank()
        reader = TieredReader(hot, cold, name=name, options=ReaderOptions(lease=False))
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            dcp.load(target, storage_reader=reader)
        assert matches(target, 1) and set(reader.sources.values()) == {"cold"}
    assert "invalid manifest" in caplog.text and "cold" in caplog.text
    Path(cold, layout.manifest_key(manifest.name)).write_bytes(b"{")  # now invalid everywhere
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            blank(),
            storage_reader=TieredReader(hot, cold, name=manifest.name, options=ReaderOptions(lease=False)),
        )
    assert isinstance(unwrap(info.value), InvalidManifest)


def test_a_damaged_copy_in_one_tier_falls_back_to_the_other_not_to_an_older_one(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    saved(hot, 1)
    newest = saved(hot, 2)
    shutil.copytree(hot, cold)
    file_path(hot, newest, "__0_0.distcp").unlink()
    flip(file_path(hot, newest, ".metadata"))
    target = blank()
    reader = TieredReader(hot, cold, options=ReaderOptions(lease=False))
    dcp.load(target, storage_reader=reader)
    assert reader.manifest is not None and reader.manifest.step == 2 and matches(target, 2)
    assert reader.sources["__0_0.distcp"] == "cold"


def test_manager_falls_back_past_a_flipped_byte_inside_a_shard(hot_dir: str, caplog) -> None:
    saved(hot_dir, 1)
    newest = saved(hot_dir, 2)
    flip(file_path(hot_dir, newest, "__0_0.distcp"))  # same size: found only while streaming
    target = blank()
    with (
        CheckpointManager(hot_dir, retention=Retention(hot_min_free=None)) as manager,
        caplog.at_level(logging.WARNING, logger="tierstore"),
    ):
        assert manager.load_latest(target) == 1
        assert matches(target, 1)  # what the failed try copied in is overwritten
        again = blank()
        assert manager.load(again) == 1 and matches(again, 1)
        # Set aside (quarantined): a load naming it says so, and never loads another one.
        assert manager.health().quarantined == (newest.name,)
        with pytest.raises(CheckpointException) as info:
            manager.load(blank(), name=newest.name)
    assert isinstance(unwrap(info.value), CheckpointNotFound)
    assert "quarantined" in str(unwrap(info.value))
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert warned and newest.name in warned[0] and "__0_0.distcp" in warned[0]


def test_manager_raises_when_nothing_loads_and_on_other_failures(hot_dir: str, caplog) -> None:
    for step in (1, 2):
        flip(file_path(hot_dir, saved(hot_dir, step), "__0_0.distcp"))
    with CheckpointManager(hot_dir, retention=Retention(hot_min_free=None)) as manager:
        with pytest.raises(CheckpointException) as info:
            manager.load_latest(blank())
        err = unwrap(info.value)
        assert isinstance(err, ChecksumMismatch) and err.checkpoint == layout.default_name(2)
    good = str(Path(hot_dir).parent / "good")
    saved(good, 1)
    saved(good, 2)
    caplog.clear()
    with (
        CheckpointManager(good, retention=Retention(hot_min_free=None)) as manager,
        caplog.at_level(logging.WARNING, logger="tierstore"),
    ):
        with pytest.raises(ConfigError, match="Missing key") as mistake:  # the caller's mistake
            manager.load_latest({**blank(), "other": torch.zeros(1)})
        assert isinstance(mistake.value.__cause__, CheckpointException)  # DCP's, chained
        assert isinstance(mistake.value, CheckpointException)  # what callers caught before
    assert "is damaged" not in caplog.text  # not retried with an older checkpoint


@pytest.mark.dist
def test_two_ranks_fall_back_together(tmp_path: Path) -> None:
    hot, out = str(tmp_path / "hot"), tmp_path / "out"
    out.mkdir()
    job = run_job({"op": "manager_fallback", "hot": hot, "out": str(out)}, 2)
    assert job.ok, job.describe()
    for rank in (0, 1):
        result = json.loads((out / f"fallback-rank{rank}.json").read_text())
        assert result == {"step": 1, "extra_step": 1, "same": True}, (rank, result)
        # Every rank sees the read error (DCP gathers them to all ranks) and moves on.
        assert "step-0000000002 is damaged" in job.ranks[rank].output, job.describe()
        assert "rank 1" in job.ranks[rank].output and "CRC32C mismatch" in job.ranks[rank].output
