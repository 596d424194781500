"""TieredWriter / TieredReader in one process (no process group): protocol and bad input."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same, blank, file_path, flip, load, load_error, save, state_for, unwrap

from tierstore import TieredReader, TieredWriter, WriterOptions, list_checkpoints
from tierstore.errors import (
    CheckpointExists,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigError,
    FaultInjected,
    IntegrityError,
    InvalidManifest,
    ObjectNotFound,
    UnsafePath,
)
from tierstore.format import layout
from tierstore.format.manifest import Manifest, _checksum
from tierstore.storage import faults
from tierstore.tiers.catalog import latest_checkpoint
from tierstore.tiers.tier import Tier

# -- the happy paths -------------------------------------------------------------------


def test_save_load_round_trip_and_manifest(hot_dir: str) -> None:
    writer = save(hot_dir, 10)
    manifest = writer.manifest
    assert manifest is not None and manifest.step == 10 and manifest.world_size == 1
    assert {f.path for f in manifest.files} == {".metadata", "__0_0.distcp"}
    for entry in manifest.files:  # every size in the manifest is the real one
        assert file_path(hot_dir, manifest, entry.path).stat().st_size == entry.size
    target, reader = load(hot_dir)
    assert_same(target, state_for(10))
    assert reader.manifest == manifest


@pytest.mark.parametrize("scheme", ["file://", "memory://", "fsspec+file://"])
def test_round_trip_on_other_builtin_backends(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}{tmp_path}/store" if scheme != "memory://" else f"memory://{tmp_path.name}"
    save(url, 1)
    save(url, 2)
    assert [c.step for c in list_checkpoints(url)] == [1, 2]
    assert_same(load(url, step=1)[0], state_for(1))
    assert_same(load(url)[0], state_for(2))


def test_async_save_thread_without_process_group(hot_dir: str) -> None:
    future = dcp.async_save(state_for(3), storage_writer=TieredWriter(hot_dir, step=3))
    future.result()
    assert_same(load(hot_dir)[0], state_for(3))


def test_newest_is_loaded_and_step_or_name_pick_others(hot_dir: str) -> None:
    for step in (5, 20, 15):
        save(hot_dir, step)
    assert [c.step for c in list_checkpoints(hot_dir)] == [5, 15, 20]
    assert latest_checkpoint(hot_dir).step == 20
    assert_same(load(hot_dir)[0], state_for(20))
    assert_same(load(hot_dir, step=5)[0], state_for(5))
    assert_same(load(hot_dir, name=layout.default_name(15))[0], state_for(15))


def test_checkpoint_id_names_the_checkpoint(hot_dir: str) -> None:
    dcp.save(state_for(1), checkpoint_id="warmup-done", storage_writer=TieredWriter(hot_dir))
    target = blank()
    dcp.load(target, checkpoint_id="warmup-done", storage_reader=TieredReader(hot_dir))
    assert_same(target, state_for(1))
    assert list_checkpoints(hot_dir)[0].name == "warmup-done"


def test_many_files_and_threads(hot_dir: str) -> None:
    writer = save(hot_dir, 1, thread_count=3, single_file_per_rank=False)
    assert len(writer.manifest.files) == 6  # .metadata + one per item (w, b, i, 2 in extra)
    assert_same(load(hot_dir)[0], state_for(1))
    save(hot_dir, 2, thread_count=2)
    assert_same(load(hot_dir)[0], state_for(2))


def test_empty_state_dict(hot_dir: str) -> None:
    dcp.save({}, storage_writer=TieredWriter(hot_dir, step=0))
    dcp.load({}, storage_reader=TieredReader(hot_dir))
    assert list_checkpoints(hot_dir)[0].num_files == 1


def test_writer_pickles_without_its_backend(hot_dir: str) -> None:
    writer = save(hot_dir, 1)
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.tiers[0]._backend is None and clone.step == 1


def test_attempt_directory_is_plain_dcp(hot_dir: str) -> None:
    # The documented way to plain DCP: encoding="dcp" (the raw default needs TieredReader).
    manifest = save(hot_dir, 4, options=WriterOptions(encoding="dcp")).manifest
    assert manifest.encoding == "dcp"
    target = blank()
    attempt_dir = Path(hot_dir, layout.attempt_prefix(manifest.name, manifest.attempt))
    dcp.load(target, storage_reader=dcp.FileSystemReader(attempt_dir))
    assert_same(target, state_for(4))


# -- commit protocol -------------------------------------------------------------------


def test_committed_checkpoint_is_never_overwritten(hot_dir: str) -> None:
    save(hot_dir, 7)
    with pytest.raises(BaseException) as info:
        dcp.save(state_for(99), storage_writer=TieredWriter(hot_dir, step=7))
    assert isinstance(unwrap(info.value), CheckpointExists)
    assert "step-0000000007" in str(unwrap(info.value))
    assert_same(load(hot_dir)[0], state_for(7))


def test_racing_attempts_on_one_step_commit_exactly_once(hot_dir: str, monkeypatch) -> None:
    # The outer save passes the "not yet committed" check, then a second attempt commits
    # the same step just before the outer one publishes: the outer publish must lose.
    real_publish = Tier.publish_manifest
    raced = []

    def publish_after_rival(self: Tier, manifest: Manifest) -> None:
        if not raced:
            raced.append(True)
            dcp.save(state_for(8), storage_writer=TieredWriter(hot_dir, step=8))
        real_publish(self, manifest)

    monkeypatch.setattr(Tier, "publish_manifest", publish_after_rival)
    with pytest.raises(BaseException) as info:
        dcp.save(state_for(1008), storage_writer=TieredWriter(hot_dir, step=8))
    assert isinstance(unwrap(info.value), CheckpointExists)
    monkeypatch.undo()
    assert [c.step for c in list_checkpoints(hot_dir)] == [8]
    assert_same(load(hot_dir)[0], state_for(8))
    attempts = os.listdir(Path(hot_dir, layout.checkpoint_prefix("step-0000000008")))
    assert len(attempts) == 2  # the loser's files are debris for GC, never listed


@pytest.mark.parametrize(
    "point", ["writer.after_file_write", "writer.after_metadata_write", "writer.before_manifest_publish"]
)
def test_failed_attempt_is_never_listed(hot_dir: str, point: str) -> None:
    save(hot_dir, 1)
    faults.arm(point)
    with pytest.raises(BaseException) as info:
        save(hot_dir, 2)
    assert isinstance(unwrap(info.value), FaultInjected)
    faults.disarm()
    assert [c.step for c in list_checkpoints(hot_dir)] == [1]
    assert_same(load(hot_dir)[0], state_for(1))
    assert Path(hot_dir, layout.checkpoint_prefix("step-0000000002")).is_dir()  # debris exists
    save(hot_dir, 2)  # and a new attempt at the same step works
    assert_same(load(hot_dir)[0], state_for(2))


def test_writer_needs_a_name(hot_dir: str) -> None:
    with pytest.raises(BaseException) as info:
        dcp.save(state_for(1), storage_writer=TieredWriter(hot_dir))
    assert isinstance(unwrap(info.value), ConfigError)
    for bad in [dict(step=-1), dict(step="3"), dict(name="../x"), dict(thread_count=0)]:
        with pytest.raises(ConfigError):
            TieredWriter(hot_dir, **bad)
    with pytest.raises(BaseException) as info:  # inside DCP's CheckpointException, as DCP's own errors
        dcp.save(state_for(1), checkpoint_id="/abs/path", storage_writer=TieredWriter(hot_dir))
    assert isinstance(unwrap(info.value), ConfigError) and "not a checkpoint name" in str(info.value)


def test_a_step_above_the_manifest_limit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from tierstore.format import manifest_format

    hot, limit = tmp_path / "hot", 1 << 62
    with pytest.raises(ConfigError, match=str(limit)):
        dcp.save(state_for(1), storage_writer=TieredWriter(str(hot), step=limit + 1))
    assert not [p for p in hot.rglob("*") if p.is_file()]
    TieredWriter(str(hot), step=limit)  # the limit itself is a step
    assert limit == manifest_format.MAX_STEP


# -- reading: not found, corruption, hostile input ---------------------------------------


def test_empty_or_missing_store_names_the_tier(tmp_path: Path) -> None:
    err = load_error(str(tmp_path / "nothing"))
    assert isinstance(err, CheckpointNotFound)
    assert "no committed checkpoint" in str(err) and str(tmp_path / "nothing") in str(err)
    save(str(tmp_path / "s"), 1)
    assert "step 9" in str(load_error(str(tmp_path / "s"), step=9))
    err = load_error(str(tmp_path / "s"), name="other")
    assert isinstance(err, CheckpointNotFound) and err.checkpoint == "other"


@pytest.mark.parametrize("offset", [0, 700, -1])
def test_flipped_byte_in_data_file_is_caught(hot_dir: str, offset: int) -> None:
    manifest = save(hot_dir, 3).manifest
    path = file_path(hot_dir, manifest)
    flip(path, offset if offset >= 0 else path.stat().st_size - 1)
    err = load_error(hot_dir)
    assert isinstance(err, ChecksumMismatch), err
    entry = manifest.file("__0_0.distcp")
    assert err.checkpoint == manifest.name and err.file == "__0_0.distcp" and "hot" in err.tier
    assert err.expected == f"{entry.crc32c:08x}" and err.actual != err.expected
    assert "CRC32C mismatch" in str(err) and manifest.name in str(err)


def test_flipped_byte_in_dcp_metadata_is_caught_before_unpickling(hot_dir: str) -> None:
    manifest = save(hot_dir, 3).manifest
    flip(file_path(hot_dir, manifest, ".metadata"), 40)
    err = load_error(hot_dir)
    assert isinstance(err, ChecksumMismatch) and err.file == ".metadata"


@pytest.mark.parametrize("change", ["truncate", "extend", "delete"])
def test_wrong_size_or_missing_file(hot_dir: str, change: str) -> None:
    manifest = save(hot_dir, 3).manifest
    path = file_path(hot_dir, manifest)
    if change == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif change == "extend":
        path.write_bytes(path.read_bytes() + b"junk")
    else:
        path.unlink()
    err = load_error(hot_dir)
    if change == "delete":
        assert isinstance(err, ObjectNotFound) and "__0_0.distcp" in str(err)
    else:
        assert isinstance(err, ChecksumMismatch) and "size mismatch" in str(err)


def rewrite_manifest(hot_dir: str, name: str, mutate) -> None:
    path = Path(hot_dir, layout.manifest_key(name))
    body = json.loads(path.read_text())
    mutate(body)
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("path", ["../../outside.distcp", "/etc/passwd"])
def test_manifest_with_escaping_path_is_rejected(hot_dir: str, path: str, caplog) -> None:
    save(hot_dir, 1)
    name = save(hot_dir, 2).manifest.name
    rewrite_manifest(hot_dir, name, lambda b: b["files"][1].update(path=path))
    err = load_error(hot_dir, name=name)
    assert isinstance(err, InvalidManifest) and "unsafe file path" in str(err)
    assert name in str(err) and "hot" in str(err)
    # Picking the newest skips the invalid checkpoint (it is not committed) and says so.
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        target, reader = load(hot_dir)
    assert reader.manifest.step == 1 and "invalid manifest" in caplog.text
    assert [c.step for c in list_checkpoints(hot_dir)] == [1]


def test_manifest_with_wrong_self_checksum_or_truncated(hot_dir: str) -> None:
    name = save(hot_dir, 1).manifest.name
    path = Path(hot_dir, layout.manifest_key(name))
    good = path.read_bytes()
    path.write_bytes(good.replace(b'"step": 1', b'"step": 2'))
    assert "self-checksum" in str(load_error(hot_dir, name=name))
    path.write_bytes(good[: len(good) // 2])
    err = load_error(hot_dir, name=name)
    assert isinstance(err, InvalidManifest) and "truncated" in str(err)
    assert list_checkpoints(hot_dir) == []


def test_symlinked_data_file_is_refused_even_with_right_bytes(hot_dir: str, tmp_path: Path) -> None:
    manifest = save(hot_dir, 1).manifest
    path = file_path(hot_dir, manifest)
    copy = tmp_path / "elsewhere.distcp"
    shutil.copy(path, copy)
    path.unlink()
    os.symlink(copy, path)
    err = load_error(hot_dir)
    assert isinstance(err, UnsafePath) and "__0_0.distcp" in str(err)


def test_forged_metadata_pickle_never_runs(hot_dir: str, tmp_path: Path) -> None:
    manifest = save(hot_dir, 1).manifest
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    file_path(hot_dir, manifest, ".metadata").write_bytes(payload)
    from tierstore.storage.backend import crc32c_update

    def forge(body: dict) -> None:  # a forger who also fixes up sizes and checksums
        for entry in body["files"]:
            if entry["path"] == ".metadata":
                entry.update(size=len(payload), crc32c=crc32c_update(0, payload))

    rewrite_manifest(hot_dir, manifest.name, forge)
    err = load_error(hot_dir)
    assert isinstance(err, IntegrityError) and "cannot be loaded safely" in str(err)
    assert not marker.exists()


def test_metadata_referencing_unlisted_file_is_rejected(hot_dir: str) -> None:
    manifest = save(hot_dir, 1).manifest

    def drop(body: dict) -> None:
        body["files"] = [f for f in body["files"] if f["path"] != "__0_0.distcp"]

    rewrite_manifest(hot_dir, manifest.name, drop)
    err = load_error(hot_dir)
    assert isinstance(err, InvalidManifest) and "does not list" in str(err)


@pytest.mark.parametrize("encoding", ["raw", "dcp"])
def test_zip_crc32_is_skipped_while_writing_and_restored_after(
    hot_dir: str, monkeypatch, encoding: str
) -> None:
    # torch's own zip CRC32 is redundant with tierstore's CRC32C (verified on every read):
    # off while a TieredWriter writes (raw: the planner's torch.save of BYTE_IO items), the
    # caller's setting back afterwards, dcp-encoded files still plain DCP that
    # FileSystemReader loads.
    seen = []
    real_save = torch.save

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.serialization.get_crc32_options())
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    assert torch.serialization.get_crc32_options() is True
    manifest = save(hot_dir, 9, options=WriterOptions(encoding=encoding)).manifest
    assert seen and not any(seen)
    assert torch.serialization.get_crc32_options() is True
    monkeypatch.undo()
    target = blank()
    dcp.load(
        target,
        storage_reader=TieredReader(hot_dir)
        if encoding == "raw"
        else dcp.FileSystemReader(Path(hot_dir, layout.attempt_prefix(manifest.name, manifest.attempt))),
    )
    assert_same(target, state_for(9))
