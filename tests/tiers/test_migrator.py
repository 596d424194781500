"""Hot -> cold migration by the background worker in one process: commit, fallback reads,
retries, failures, SIGKILL at every migrator fault point followed by `tierstore migrate`."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import flaky
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import file_path, flip, load, load_error, matches, save

from tierstore import Store, TieredReader, list_checkpoints
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.migrator import MigrationOptions, MigrationState, Migrator
from tierstore.migration.status import migrate_pending, migration_status, wait_for_migrations
from tierstore.retry import RetryPolicy
from tierstore.testing.faults import armed_env
from tierstore.tiers.tier import Tier

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=5,
    retry=RetryPolicy(attempts=5, initial=0.001, maximum=0.01),
)


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "hot"), str(tmp_path / "cold")


@pytest.fixture
def flaky_cold(tmp_path: Path, registered_backend) -> str:
    registered_backend("flaky", flaky.FlakyBackend)
    root = str(tmp_path / "cold")
    flaky.FAILURES.pop(root, None)
    flaky.CALLS.pop(root, None)
    return f"flaky://{root}"


def test_save_migrates_and_cold_alone_loads(tiers) -> None:
    hot, cold = tiers
    writers = [save(hot, step, cold, migration=FAST) for step in (1, 2, 3)]
    migrator = writers[0].migrator
    assert migrator is writers[-1].migrator  # one per process for this (hot, cold)
    assert migrator.wait(30)
    states = {s.name: s for s in migrator.status()}
    assert [states[layout.default_name(s)].state for s in (1, 2, 3)] == [MigrationState.COMMITTED] * 3
    assert all(s.lag_bytes == 0 and s.lag_seconds >= 0 for s in states.values())
    assert [(c.step, c.tiers) for c in list_checkpoints(Store.of(hot, cold))] == [
        (s, ("hot", "cold")) for s in (1, 2, 3)
    ]
    hot_m = Tier("hot", hot).find_manifest(layout.default_name(3))
    assert Tier("cold", cold).find_manifest(layout.default_name(3)) == hot_m
    shutil.rmtree(hot)
    target, reader = load(hot, cold)
    assert matches(target, 3) and reader.manifest.step == 3


def test_flipped_hot_byte_falls_back_to_cold_and_warns(tiers, caplog) -> None:
    hot, cold = tiers
    manifest = save(hot, 5, cold, migration=FAST).manifest
    assert wait_for_migrations(Store.of(hot, cold), timeout=30)[0].state is MigrationState.COMMITTED
    flip(file_path(hot, manifest, "__0_0.distcp"))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        target, _ = load(hot, cold)
    assert matches(target, 5)
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("__0_0.distcp" in w and "CRC32C mismatch" in w for w in warning), warning
    # Without the cold tier the same damage is a clear error, never a silent load.
    assert "CRC32C mismatch" in str(load_error(hot, None))


def test_transient_failures_are_retried_until_committed(tiers, flaky_cold) -> None:
    hot, _ = tiers
    root = flaky_cold[len("flaky://") :]
    flaky.FAILURES[root].update(open_write=3, publish=2)
    writer = save(hot, 1, flaky_cold, migration=FAST)
    assert writer.migrator.wait(30)
    [status] = writer.migrator.status()
    assert status.state is MigrationState.COMMITTED, status
    assert flaky.FAILURES[root]["open_write"] == 0 and flaky.FAILURES[root]["publish"] == 0
    assert [c.tiers for c in list_checkpoints(Store.of(hot, flaky_cold))] == [("hot", "cold")]


def test_permanent_failure_is_reported_and_training_saves_keep_working(
    tiers, tmp_path, registered_backend
) -> None:
    hot, _ = tiers
    registered_backend("flaky", flaky.FlakyBackend)
    root = str(tmp_path / "cold-denied")
    flaky.FAILURES[root].update(open_write=1)
    cold = f"flaky://{root}"
    opts = {"permanent": True}
    first = save(hot, 1, cold, cold_options=opts, migration=FAST)  # returns: migration is background work
    assert first.migrator.wait(30)
    [failed] = first.migrator.failures()
    assert failed.name == layout.default_name(1) and failed.rank == 0 and failed.failed_rank == 0
    assert failed.failed_file in {".metadata", "__0_0.distcp"}
    assert "403 AccessDenied" in failed.error and failed.lag_bytes > 0
    second = save(hot, 2, cold, cold_options=opts, migration=FAST)  # the next save works and migrates
    assert second.migrator.wait(30)
    by_name = {s.name: s.state for s in second.migrator.status()}
    assert by_name[layout.default_name(2)] is MigrationState.COMMITTED
    assert [c.step for c in list_checkpoints(Store(cold=cold, cold_options=opts))] == [2]
    assert matches(load(hot, None, step=1)[0], 1)  # hot copy intact
    # The tiers' own view shows the failure too (the failure mark was published).
    statuses = {s.name: s for s in migration_status(Store.of(hot, cold, cold_options=opts))}
    assert statuses[layout.default_name(1)].state is MigrationState.FAILED
    assert "403" in statuses[layout.default_name(1)].error


def test_commit_gives_up_waiting_for_a_missing_rank(tiers) -> None:
    hot, cold = tiers
    save(hot, 1, migration=FAST)
    real = Tier("hot", hot).find_manifest(layout.default_name(1))
    # Pretend rank 1 of 2 also owned a file, and never uploaded it.
    ghost = Manifest(
        name=real.name,
        step=real.step,
        attempt=real.attempt,
        world_size=2,
        created=real.created,
        files=real.files + (FileEntry("__1_0.distcp", 10, 0, 1),),
    )
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    migrator = Migrator(
        Tier("hot", hot),
        Tier("cold", cold),
        MigrationOptions(poll_interval=0.01, commit_timeout=0.2),
        sleep=sleep,
    )
    migrator.submit_commit(ghost, rank=0)
    assert migrator.wait(30)
    [status] = migrator.status()
    assert status.state is MigrationState.FAILED and status.failed_rank == 1
    assert "no upload mark from ranks [1]" in status.error
    assert list_checkpoints(Store(cold=cold)) == []  # never a partial cold checkpoint
    # The polls back off from poll_interval, doubling (MigrationOptions.mark_polling).
    assert slept[:3] == pytest.approx([0.01, 0.02, 0.04])


def script_state() -> dict:
    """What SAVE_SCRIPT saves (its own, smaller state than helpers.state_for's)."""
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(200, 50, generator=g), "extra": {"step": 1}}


SAVE_SCRIPT = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.filterwarnings("ignore")
from tierstore import TieredWriter
from tierstore.migration.migrator import MigrationOptions
hot, cold = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(1)
state = {"w": torch.randn(200, 50, generator=g), "extra": {"step": 1}}
writer = TieredWriter(hot, cold, step=1, migration=MigrationOptions(chunk_size=4096))
dcp.save(state, storage_writer=writer)
writer.migrator.wait()
print("migrated")
"""

MIGRATOR_POINTS = [
    "transfer.after_chunk@3",
    "migrator.after_file_upload",
    "migrator.before_mark_publish",
    "migrator.before_cold_publish",
    "local.publish.after_temp_fsync@2",
]


@pytest.mark.parametrize("point", MIGRATOR_POINTS)
def test_sigkill_mid_migration_then_cli_completes(tiers, point: str) -> None:
    hot, cold = tiers
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_SCRIPT, hot, cold],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **armed_env(f"{point}=kill")},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [c.step for c in list_checkpoints(hot)] == [1]
    assert list_checkpoints(Store(cold=cold)) == []  # no partial cold checkpoint is ever listed
    [pending] = migration_status(Store.of(hot, cold))
    assert pending.state in (MigrationState.PENDING, MigrationState.UPLOADING)
    cli = subprocess.run(
        [sys.executable, "-m", "tierstore", "migrate", "--hot", hot, "--cold", cold],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "step-0000000001: committed" in cli.stdout
    target = {"w": torch.zeros(200, 50), "extra": {"step": -1}}
    dcp.load(target, storage_reader=TieredReader(None, cold))
    want = script_state()
    assert torch.equal(target["w"], want["w"]) and target["extra"] == want["extra"]
    again = subprocess.run(
        [sys.executable, "-m", "tierstore", "migrate", "--hot", hot, "--cold", cold],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "nothing to migrate" in again.stdout


def test_rerun_skips_what_is_already_uploaded_and_verified(tiers, flaky_cold) -> None:
    hot, _ = tiers
    root = flaky_cold[len("flaky://") :]
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_SCRIPT, hot, f"file://{root}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **armed_env("migrator.before_cold_publish=kill")},
    )
    assert proc.returncode == -9
    flaky.CALLS[root].clear()
    [result] = migrate_pending(Store.of(hot, flaky_cold), config=FAST)
    assert result.state is MigrationState.COMMITTED
    assert flaky.CALLS[root]["open_write"] == 0  # every file was already there and intact
    assert flaky.CALLS[root]["publish"] == 1  # only the cold manifest


def test_stop_ends_a_commit_waiting_for_marks_and_the_jobs_behind_it(tmp_path: Path) -> None:
    """What close() gives up on never runs on: a commit waiting for a rank's mark ends (issue
    22, item 4). The commit waits on a thread of its own (issue 34), so the job queued behind
    it may have run before the stop; if it had not, it never starts."""
    import time

    from test_cold_commit_scale import rank_job, write_attempt

    from tierstore.migration.migrator import MigrationOptions, MigrationState, Migrator
    from tierstore.tiers.tier import Tier

    hot, cold = Tier("hot", str(tmp_path / "hot")), Tier("cold", str(tmp_path / "cold"))
    manifest = write_attempt(hot, world=3)  # rank 1 never uploads: the commit waits for it
    migrator = Migrator(hot, cold, MigrationOptions(poll_interval=0.05, commit_timeout=600))
    commit = rank_job(manifest, 0, commit=True)
    queued = rank_job(manifest, 2)
    migrator._enqueue(commit)
    migrator._enqueue(queued)
    deadline = time.monotonic() + 10
    while commit.state is MigrationState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    migrator.stop()
    assert migrator.wait(15), "stopped jobs still running"
    assert time.monotonic() - started < 12
    assert commit.state is MigrationState.FAILED and "stopped" in (commit.error or "")
    assert queued.state is MigrationState.UPLOADED or (
        queued.state is MigrationState.FAILED and "stopped" in (queued.error or "")
    ), queued
    assert cold.find_manifest(manifest.name) is None
