"""Copying one committed checkpoint to another tier (tierstore.migration.copy, issue 26 item 2):
verified on the way, committed at the destination last, resumable after SIGKILL, never over
another attempt, and leaving the source's own migration state alone. The command's exit codes
and lines: tests/cli/test_cli_copy.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cold_tiers import Cold, cold_of
from helpers import file_path, flip, load, matches, save, saved

from tierstore import (
    CheckpointExists,
    CheckpointNotFound,
    Store,
    TieredReader,
    list_checkpoints,
    migration_status,
)
from tierstore.errors import ChecksumMismatch
from tierstore.format import layout
from tierstore.migration.copy import copy_checkpoint
from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.migration.status import migrate_pending
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.testing.faults import armed_env

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=5,
    retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.01),
)


def keys(root: str | Path) -> dict[str, int]:
    """Every file under a local tier, with its modification time (ns)."""
    base = Path(root)
    return {str(p.relative_to(base)): p.stat().st_mtime_ns for p in base.rglob("*") if p.is_file()}


@pytest.fixture(params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    yield from cold_of(request, request.param, tmp_path)


def test_hot_to_another_directory_loads_bit_exact_from_it_alone(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    save(hot, 1)
    manifest = saved(hot, 2)
    seen: list[tuple[str, int, int]] = []
    report = copy_checkpoint(hot, dest, step=2, config=FAST, progress=lambda *a: seen.append(a))
    assert report.manifest == manifest and not report.already_there
    assert report.bytes_sent == manifest.total_size and report.files_sent == len(manifest.files)
    assert seen[-1] == (manifest.name, manifest.total_size, manifest.total_size)
    assert [c.step for c in list_checkpoints(dest)] == [2]  # only the one asked for
    target, reader = load(dest)
    assert matches(target, 2) and reader.manifest == manifest
    before = keys(dest)
    again = copy_checkpoint(hot, dest, name=manifest.name, config=FAST)
    assert again.already_there and again.bytes_sent == 0 and keys(dest) == before


def test_hot_to_a_bucket_then_from_the_bucket_alone_to_a_laptop(tmp_path: Path, remote: Cold) -> None:
    hot, laptop = str(tmp_path / "hot"), str(tmp_path / "laptop")
    manifest = saved(hot, 3)
    copy_checkpoint(hot, remote.url, step=3, destination_options=remote.options, config=FAST)
    assert [c.step for c in list_checkpoints(Store(remote.url, hot_options=remote.options))] == [3]
    target = load(None, remote.url, cold_options=remote.options)[0]
    assert matches(target, 3)
    # The bucket as the cold tier of a store whose hot tier lacks the checkpoint: read from cold.
    shutil.rmtree(hot)
    os.mkdir(hot)
    source = Store(hot, remote.url, cold_options=remote.options)
    report = copy_checkpoint(source, laptop, name=manifest.name, config=FAST)
    assert report.source == (source.cold.label,)  # type: ignore[union-attr]
    assert matches(load(laptop)[0], 3) and [c.step for c in list_checkpoints(laptop)] == [3]


def test_a_damaged_source_file_fails_naming_it_and_nothing_is_committed(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    manifest = saved(hot, 1)
    flip(file_path(hot, manifest))
    with pytest.raises(ChecksumMismatch) as info:
        copy_checkpoint(hot, dest, step=1, config=FAST)
    err = info.value
    assert (err.file, err.checkpoint, err.tier) == (layout.data_file_name(0, 0), manifest.name, f"hot {hot}")
    assert list_checkpoints(dest) == []
    assert not Path(dest, layout.manifest_key(manifest.name)).exists()
    with pytest.raises(CheckpointNotFound):
        copy_checkpoint(hot, dest, step=9, config=FAST)


def test_a_file_damaged_in_the_hot_tier_is_copied_from_the_cold_one(tmp_path: Path) -> None:
    hot, cold, dest = (str(tmp_path / d) for d in ("hot", "cold", "dest"))
    manifest = saved(hot, 1)
    store = Store(hot, cold)
    [done] = migrate_pending(store, config=FAST)
    assert done.state is MigrationState.COMMITTED
    flip(file_path(hot, manifest))
    report = copy_checkpoint(store, dest, step=1, config=FAST)
    assert report.source == (f"hot {hot}", f"cold {cold}")  # the nearest first, then the verified one
    assert matches(load(dest)[0], 1)
    assert [c.step for c in list_checkpoints(dest)] == [1]


def test_a_different_attempt_at_the_destination_is_refused_untouched(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    mine, theirs = saved(hot, 1), saved(dest, 1)  # two saves of step 1: two attempts
    assert mine.attempt != theirs.attempt
    before = keys(dest)
    with pytest.raises(CheckpointExists) as info:
        copy_checkpoint(hot, dest, step=1, config=FAST)
    assert info.value.checkpoint == mine.name and info.value.tier == f"destination {dest}"
    assert keys(dest) == before  # not a byte of the other attempt sent
    assert TieredReader(dest).read_metadata() is not None
    assert Store(dest).hot.find_manifest(mine.name) == theirs  # type: ignore[union-attr]


def test_a_copy_elsewhere_leaves_the_source_pending_for_its_own_cold_tier(tmp_path: Path) -> None:
    hot, cold, dest = (str(tmp_path / d) for d in ("hot", "cold", "dest"))
    manifest = saved(hot, 1)  # hot only: pending for the store's cold tier
    store = Store(hot, cold)
    [before] = migration_status(store)
    assert before.state is MigrationState.PENDING
    hot_before = keys(hot)
    copy_checkpoint(store, dest, step=1, config=FAST)
    [after] = migration_status(store)
    assert after.state is MigrationState.PENDING  # prune still keeps it hot until it is cold
    assert keys(hot) == hot_before  # no migrated mark (for any tier), no lease left behind
    assert not Path(cold).exists() or not any(Path(cold).rglob("*.json"))
    # Once it is migrated to its own cold tier, it is committed there as before.
    [done] = migrate_pending(store, config=FAST)
    assert done.state is MigrationState.COMMITTED and done.name == manifest.name


COPY = [sys.executable, "-m", "tierstore", "cp", "--concurrency", "1", "--json"]


def test_sigkill_mid_copy_then_the_rerun_sends_only_what_is_missing(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    manifest = saved(hot, 1, single_file_per_rank=False)  # a file per item, and .metadata: 6 files
    assert len(manifest.files) == 6
    args = [*COPY, "--hot", hot, "--step", "1", "--to", dest]
    killed = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **armed_env("migrator.after_file_upload@2=kill")},
    )
    assert killed.returncode == -9, killed.stderr
    assert list_checkpoints(dest) == []  # never half-visible
    trace = tmp_path / "trace"
    rerun = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **armed_env(trace=trace)},
    )
    assert rerun.returncode == 0, rerun.stderr
    body = json.loads(rerun.stdout)
    uploads = [line for line in trace.read_text().splitlines() if "migrator.after_file_upload" in line]
    assert len(uploads) == body["files_sent"] == 4  # the two verified before the kill are not sent again
    assert 0 < body["bytes_sent"] < manifest.total_size
    assert matches(load(dest)[0], 1)
    again = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and json.loads(again.stdout)["already_there"] is True


def test_another_attempt_committed_at_the_destination_mid_copy_wins_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot, dest, block = str(tmp_path / "hot"), str(tmp_path / "dest"), tmp_path / "block"
    block.mkdir()
    mine = saved(hot, 1)
    monkeypatch.setenv(faults.BLOCK_DIR_ENV, str(block))
    faults.arm("copy.before_publish", "block")  # every file sent and marked, not yet published
    outcome: list[BaseException] = []

    def copy() -> None:
        try:
            copy_checkpoint(hot, dest, step=1, config=FAST)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=copy)
    thread.start()
    deadline = time.monotonic() + 30
    while not list(block.glob("copy.before_publish.*.reached")):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)
    theirs = saved(dest, 1)  # a save into the destination takes the name meanwhile
    (block / "copy.before_publish.release").touch()
    thread.join(30)
    faults.disarm()
    [err] = outcome
    assert isinstance(err, CheckpointExists) and "meanwhile" in str(err), err
    assert Store(dest).hot.find_manifest(mine.name) == theirs  # type: ignore[union-attr]
    assert matches(load(dest)[0], 1) and load(dest)[1].manifest == theirs
