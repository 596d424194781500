"""What the hot tier may believe about the cold tier (issue: the cold tier never blocks or
breaks training; hostile stores and racing actors).

* a migrated mark names the cold tier it refers to: re-pointing a hot tier at a new (or
  mistyped) cold tier makes its checkpoints pending again, and prune keeps them;
* prune trusts only a valid cold copy: a torn cold manifest protects the hot copy;
* two migrators of one checkpoint never undo each other, and the cold manifest vouches only
  for objects in place at the commit;
* damaged or wrong upload marks are repaired, not a wedge;
* a save never asks the cold tier anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import flaky
import pytest
import torch.distributed.checkpoint as dcp
from helpers import load, matches, save, state_for

from tierstore import Retention, Store, TieredWriter, list_checkpoints
from tierstore.errors import BackendNotFound
from tierstore.format import layout
from tierstore.format.manifest import FileEntry
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.migrator import Job as _Job
from tierstore.migration.migrator import MigrationOptions, MigrationState, Migrator
from tierstore.migration.status import migrate_pending, migration_status
from tierstore.retry import RetryPolicy
from tierstore.storage.local import LocalBackend
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=5,
    retry=RetryPolicy(attempts=3, initial=0.001, maximum=0.01),
)


def states(hot: str, cold: str) -> dict[int | None, str]:
    return {s.step: s.state.value for s in migration_status(Store.of(hot, cold))}


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "hot"), str(tmp_path / "cold")


def test_repointed_hot_tier_is_pending_for_the_new_cold_tier(tiers: tuple[str, str], tmp_path: Path) -> None:
    hot, cold_a = tiers
    for step in (1, 2):
        save(hot, step, cold_a, migration=FAST, migrated=True)
    assert states(hot, cold_a) == {1: "committed", 2: "committed"}
    cold_b = str(tmp_path / "new-bucket")  # re-pointed (or mistyped): holds nothing
    # Before: the hot tier's marks said "migrated" whatever the cold tier: status said
    # committed, migrate had nothing to do, and prune deleted what cold B never held.
    assert states(hot, cold_b) == {1: "pending", 2: "pending"}
    reports = prune(Store.of(hot, cold_b), hot_policy=keep_last(1), cold_policy=keep_last(5))
    assert reports[0].deleted == ()
    assert "step-0000000001" in reports[0].protected
    done = migrate_pending(Store.of(hot, cold_b), config=FAST)
    assert [s.state for s in done] == [MigrationState.COMMITTED] * 2
    assert states(hot, cold_b) == {1: "committed", 2: "committed"}
    assert matches(load(None, cold_b, step=1)[0], 1)
    # Cold A is still known for what it holds: its identity differs from B's.
    assert states(hot, cold_a) == {1: "committed", 2: "committed"}
    ids = {json.loads((Path(c) / layout.STORE_ID_KEY).read_text())["store_id"] for c in (cold_a, cold_b)}
    assert len(ids) == 2


def test_a_checkpoint_pruned_from_cold_by_policy_may_leave_hot(tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    for step in (1, 2, 3):
        save(hot, step, cold, migration=FAST, migrated=True)
    prune(Store(cold=cold), cold_policy=keep_last(1))  # cold keeps only step 3
    assert states(hot, cold) == {1: "committed", 2: "committed", 3: "committed"}
    reports = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(1))
    assert set(reports[0].deleted) == {"step-0000000001", "step-0000000002"}


def test_prune_keeps_the_hot_copy_when_the_cold_manifest_is_torn(tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    for step in (1, 2):
        save(hot, step, cold, migration=FAST, migrated=True)
    torn = Path(cold) / layout.manifest_key("step-0000000001")
    torn.write_bytes(torn.read_bytes()[:40])
    reports = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(5))
    assert reports[0].deleted == ()
    assert any("step-0000000001" in w and "invalid" in w for w in reports[0].warnings)
    assert matches(load(hot, None, step=1)[0], 1)  # the only good copy is still there
    status = {s.step: s for s in migration_status(Store.of(hot, cold))}
    assert status[1].state is MigrationState.FAILED and "invalid" in (status[1].error or "")


def test_prune_keeps_every_hot_copy_when_the_cold_tier_cannot_be_read(
    tiers: tuple[str, str], tmp_path: Path
) -> None:
    hot, cold = tiers
    for step in (1, 2):
        save(hot, step, cold, migration=FAST, migrated=True)
    identity = Path(cold) / layout.STORE_ID_KEY
    identity.write_text("{not json")  # nothing can be proved about this cold tier now
    reports = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(5))
    assert reports[0].deleted == ()
    assert any("cannot be read" in w for w in reports[0].warnings)


def test_second_migrator_that_is_throttled_never_deletes_a_committed_object(
    tiers: tuple[str, str], registered_backend
) -> None:
    hot, cold = tiers
    registered_backend("flaky", flaky.FlakyBackend)
    save(hot, 1, migration=FAST)
    manifest = Tier("hot", hot).find_manifest("step-0000000001")
    assert manifest is not None
    assert migrate_pending(Store.of(hot, cold), config=FAST)[0].state is MigrationState.COMMITTED
    # A second migrator of the same checkpoint looked before the first one wrote (no
    # verified copy yet), then got throttled on every write. Before: each retry deleted the
    # key first, removing the object the first migrator had verified and committed.
    flaky_cold = Tier("cold", f"flaky://{cold}")
    second = Migrator(Tier("hot", hot), flaky_cold, FAST)
    flaky.FAILURES[flaky_cold.backend.root]["open_write"] = 100
    try:
        for entry in manifest.files:
            job = _Job(manifest.name, manifest.attempt, manifest.step, entry.rank, (entry,), 0.0)
            with pytest.raises(Exception, match="SlowDown"):
                _upload_without_check(second, job, entry)
    finally:
        flaky.FAILURES.clear()
        second.close()
    assert matches(load(None, cold, step=1)[0], 1)


def _upload_without_check(migrator: Migrator, job: _Job, entry: FileEntry) -> None:
    import tierstore.migration.migrator as mod

    original = mod.verified_copy
    mod.verified_copy = lambda *a, **k: None  # type: ignore[assignment]
    try:
        migrator._upload_file(job, entry, {})
    finally:
        mod.verified_copy = original  # type: ignore[assignment]


def test_cold_commit_refuses_when_a_named_object_is_gone(
    tiers: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hot, cold = tiers
    save(hot, 1, migration=FAST)
    manifest = Tier("hot", hot).find_manifest("step-0000000001")
    assert manifest is not None
    migrator = Migrator(Tier("hot", hot), Tier("cold", cold), FAST)
    for rank in sorted({f.rank for f in manifest.files}):
        job = _Job(manifest.name, manifest.attempt, manifest.step, rank, manifest.files_of_rank(rank), 0.0)
        migrator.run(job)
        assert job.state is MigrationState.UPLOADED
    victim = next(f for f in manifest.files if f.path != layout.METADATA_FILE)
    # Another actor removes an object after the marks were checked, before the commit.
    real_store_id = marks.store_id

    def remove_then_identify(tier: Tier, **kwargs: Any) -> str | None:
        (Path(cold) / layout.file_key(manifest.name, manifest.attempt, victim.path)).unlink(missing_ok=True)
        return real_store_id(tier, **kwargs)

    monkeypatch.setattr(marks, "store_id", remove_then_identify)
    job = _Job(
        manifest.name, manifest.attempt, manifest.step, 0, manifest.files_of_rank(0), 0.0, manifest=manifest
    )
    migrator.run(job)
    migrator.close()
    monkeypatch.undo()
    assert job.state is MigrationState.FAILED and victim.path in (job.error or "")
    assert Tier("cold", cold).find_manifest(manifest.name) is None  # never vouched for a hole
    # `tierstore migrate` uploads it again (the rank's mark is there, the file is not).
    assert migrate_pending(Store.of(hot, cold), config=FAST)[0].state is MigrationState.COMMITTED
    assert matches(load(None, cold, step=1)[0], 1)


@pytest.mark.parametrize("damage", ["truncated", "wrong rank", "oversize", "other files"])
def test_damaged_upload_mark_does_not_wedge_migration(tiers: tuple[str, str], damage: str) -> None:
    hot, cold = tiers
    save(hot, 1, migration=FAST)
    manifest = Tier("hot", hot).find_manifest("step-0000000001")
    assert manifest is not None
    mark = Path(cold) / layout.upload_mark_key(manifest.name, manifest.attempt, 0)
    mark.parent.mkdir(parents=True)
    good = {
        "rank": 0,
        "files": [
            {"path": f.path, "size": f.size, "crc32c": f.crc32c, "rank": 0} for f in manifest.files_of_rank(0)
        ],
    }
    body = {
        "truncated": json.dumps(good)[:25],
        "wrong rank": json.dumps({**good, "rank": 3}),
        "oversize": " " * (65 << 20),
        "other files": json.dumps(
            {
                **good,
                "files": good["files"][:1] + [{"path": "__0_9.distcp", "size": 1, "crc32c": 0, "rank": 0}],
            }
        ),
    }[damage]
    mark.write_text(body)
    # Before: PublishConflict on every run, forever (412 on S3).
    for _ in range(2):
        status = migrate_pending(Store.of(hot, cold), config=FAST)
        if status and status[0].state is MigrationState.COMMITTED:
            break
    assert states(hot, cold) == {1: "committed"}
    assert matches(load(None, cold, step=1)[0], 1)


def test_a_different_committed_cold_attempt_is_a_reported_conflict(
    tiers: tuple[str, str], tmp_path: Path
) -> None:
    hot, cold = tiers
    save(hot, 1, cold, migration=FAST, migrated=True)
    other_hot = str(tmp_path / "other-hot")
    # same name, another attempt; the cold tier keeps the first
    save(other_hot, 1, cold, migration=FAST, migrated=True)
    status = {s.step: s for s in migration_status(Store.of(other_hot, cold))}
    assert status[1].state is MigrationState.FAILED
    assert "another attempt" in (status[1].error or "")
    assert matches(load(hot, None, step=1)[0], 1)
    reports = prune(Store.of(other_hot, cold), hot_policy=keep_last(0), cold_policy=keep_last(5))
    assert reports[0].deleted == ()  # the only copy of that attempt stays
    run = subprocess.run(
        [sys.executable, "-m", "tierstore", "status", "--hot", other_hot, "--cold", cold],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # a failed migration is not "fine"
    assert "another" in run.stdout


class SpyBackend(LocalBackend):
    """A local tier that records which thread called it, for every operation."""

    scheme = "spy"
    CALLERS: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url.replace("spy://", "file://", 1), **options)

    def _seen(self, op: str) -> None:
        self.CALLERS.append((op, threading.current_thread().name))


for _op in ("exists", "stat", "list", "open_read", "open_write", "publish", "delete", "read_bytes"):

    def _spied(self: SpyBackend, *args: Any, _op: str = _op, **kwargs: Any) -> Any:
        self._seen(_op)
        return getattr(LocalBackend, _op)(self, *args, **kwargs)

    setattr(SpyBackend, _op, _spied)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_sends_nothing_to_the_cold_tier(tiers: tuple[str, str], mode: str, registered_backend) -> None:
    hot, cold = tiers
    registered_backend("spy", SpyBackend)
    SpyBackend.CALLERS.clear()
    writer = TieredWriter(hot, f"spy://{cold}", step=1, migration=FAST)
    if mode == "sync":
        dcp.save(state_for(1), storage_writer=writer)
    else:
        dcp.async_save(state_for(1), storage_writer=writer).result()
    migrator = writer.migrator
    assert migrator is not None and migrator.wait(30)
    # Before: prepare_global_plan asked every tier, cold included, whether the name existed.
    save_path = [(op, who) for op, who in SpyBackend.CALLERS if not who.startswith("tierstore-")]
    assert save_path == []
    assert SpyBackend.CALLERS  # the background migrator did reach it
    assert matches(load(None, f"spy://{cold}", step=1)[0], 1)


def test_unknown_scheme_is_reported_when_the_writer_is_built(tmp_path: Path) -> None:
    with pytest.raises(BackendNotFound, match="nosuch"):
        TieredWriter(str(tmp_path / "hot"), "nosuch://bucket/run", step=1)


def test_a_migrator_finds_its_checkpoint_committed_by_another(tiers: tuple[str, str]) -> None:
    """Found by the multi-actor machine: the trainer's migrator was held after uploading;
    `tierstore migrate` committed the checkpoint and removed every upload mark; the trainer's
    migrator then waited the whole commit_timeout for marks that would never come, and
    reported a failure for a checkpoint that was committed."""
    hot, cold = tiers
    save(hot, 1, migration=FAST)
    manifest = Tier("hot", hot).find_manifest("step-0000000001")
    assert manifest is not None
    trainer = Migrator(Tier("hot", hot), Tier("cold", cold), FAST)
    job = _Job(
        manifest.name, manifest.attempt, manifest.step, 0, manifest.files_of_rank(0), 0.0, manifest=manifest
    )
    trainer._upload_rank(job)  # uploaded and marked; now held before waiting for the marks
    assert migrate_pending(Store.of(hot, cold), config=FAST)[0].state is MigrationState.COMMITTED
    assert not list((Path(cold) / layout.UPLOAD_DIR).rglob("*.json"))  # marks cleared
    trainer._commit(manifest)  # before: _Failed "no upload mark from ranks [0]" after 5 s
    trainer.close()
    assert states(hot, cold) == {1: "committed"}


def test_a_cold_tier_wiped_and_recreated_under_the_same_url_holds_nothing(tiers: tuple[str, str]) -> None:
    """A name that is reused: the bucket emptied and re-created while the trainer runs. The
    marks name the old tier's identity, which this process had already read once."""
    import shutil
    import warnings

    from tierstore import CheckpointManager

    hot, cold = tiers
    manager = CheckpointManager(
        hot, cold, save_every=1, retention=Retention(hot=keep_last(1), cold=keep_last(5)), migration=FAST
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            manager.save(step, state_for(step))
        manager.wait()
        manager.prune()  # reads (and keeps, for the pre-save check) the cold tier's identity
        shutil.rmtree(cold)
        Path(cold).mkdir()
        manager.save(3, state_for(3), force=True)
        manager.wait(migrations=False)
        manager._maintenance.migrators()[0].wait(30)
        reports = manager.prune()
        # The old marks (another identity) never let steps 1 and 2 go from hot: only a commit
        # in the new cold tier does (the manager migrates them there again, as pending).
        in_new_cold = {c.name for c in list_checkpoints(Store(cold=cold))}
        assert set(reports[0].deleted) <= in_new_cold, (reports[0].deleted, in_new_cold)
        manager.close()
    # Step 1 lived only in the wiped tier (hot had let it go against the old one); step 2,
    # still hot, reached the new one.
    assert {c.step for c in list_checkpoints(Store(cold=cold))} == {2, 3}
    assert matches(load(hot, cold, step=2)[0], 2)
