"""One job per checkpoint, no job that waits for nothing, a breaker that probes, and
deadlines spent trying (docs/design.md invariants 25 and 26; issue 34, items 1 and 2).

Each test is a repro of what an outside test found, against every kind of cold tier
(tests/cold_tiers.py: a local directory, moto's S3, the same behind a latency proxy,
fake-gcs-server), each one a cold tier that can go down and come back (``switchable_cold``):

* a maintenance round's view of what is pending is older than its act: a checkpoint whose
  migration committed in between is never queued again, and a job queued for an attempt
  delivered elsewhere ends before it uploads anything;
* a commit whose attempt the cold prune deleted while it waited for the marks ends at once,
  not after ``commit_timeout``; a commit waiting for a rank that never marks never holds the
  queue;
* ``close()`` and ``wait()`` name only checkpoints that are really pending: not one another
  migrator delivered and the cold policy pruned since;
* after one refusal, the breaker lets a probe through, and ``close()`` and the preemption
  push keep trying until their deadline, so a cold tier that blipped still gets the
  checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cold_tiers import Cold
from simulated_ranks import save_ranks

from tierstore import CheckpointManager, PreemptionOptions, Retention, keep_last
from tierstore.errors import MigrationFailed
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.prune import prune_tier
from tierstore.migration.delivery import resume_pending, undelivered
from tierstore.migration.migrator import MigrationOptions, MigrationState, Migrator
from tierstore.migration.status import migrate_pending
from tierstore.options import ManagerOptions
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.tiers.tier import Store, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crash"))
from gates import Gate

FAST = MigrationOptions(
    chunk_size=1 << 16,
    poll_interval=0.02,
    commit_timeout=60,  # long: a commit that waits for nothing would show in the wall time
    retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.05),
)


def tiers(hot: Path, cold: Cold) -> tuple[Tier, Tier]:
    return Tier("hot", str(hot)), Tier("cold", cold.url, cold.options)


def committed(migrator: Migrator, manifest: Manifest, timeout: float = 30) -> None:
    assert migrator.wait(timeout), [s for s in migrator.status() if s.name == manifest.name]
    states = {s.state for s in migrator.status() if s.name == manifest.name}
    assert states == {MigrationState.COMMITTED}, migrator.status()


def versions(cold: Cold, manifest: Manifest) -> dict[str, str | None]:
    """Every stored object of ``manifest``'s attempt in the cold tier, with its version."""
    prefix = layout.attempt_prefix(manifest.name, manifest.attempt)
    return {info.key: info.version for info in cold.tier.backend.list(prefix)}


def test_a_stale_pending_view_never_queues_a_second_job(switchable_cold: Cold, tmp_path: Path) -> None:
    """The round lists X pending, X's own job commits, then the round acts on its listing."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    manifest, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    migrator = Migrator(hot, cold, FAST)
    looked = time.monotonic()  # the round's look at the cold tier: X pending
    assert migrator.submit_commit(manifest, 0, fresh=True)
    committed(migrator, manifest)
    stored = versions(switchable_cold, manifest)
    assert resume_pending(migrator, hot, [manifest.name], since=looked) == []
    assert not migrator.submit_commit(manifest, 0)
    assert len([s for s in migrator.status() if s.name == manifest.name]) == 1
    # Another process's migrator (a second manager, `tierstore migrate`) with the same stale
    # view: its job asks the hot tier first and ends without a request to upload anything.
    other = Migrator(
        Tier("hot", str(tmp_path / "hot")), Tier("cold", switchable_cold.url, switchable_cold.options)
    )
    assert other.submit_checkpoint(manifest)
    committed(other, manifest)
    assert all(s.bytes_total == s.bytes_done for s in other.status())
    assert versions(switchable_cold, manifest) == stored  # nothing uploaded again
    migrator.close()
    other.close()


def test_a_checkpoint_lost_by_the_cold_tier_is_delivered_again(switchable_cold: Cold, tmp_path: Path) -> None:
    """The other side of the dedup: a look that began after the delivery and still finds
    it pending (the cold tier lost it, wiped and re-created) queues it again."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    manifest, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    migrator = Migrator(hot, cold, FAST)
    migrator.submit_commit(manifest, 0, fresh=True)
    committed(migrator, manifest)
    cold.unpublish(manifest)  # gone from the cold tier (its migrated mark names it still)
    switchable_cold.tier.backend.delete(layout.STORE_ID_KEY)  # a new tier under the same URL
    assert resume_pending(migrator, hot, [manifest.name], since=time.monotonic()) == [manifest.name]
    committed(migrator, manifest)
    assert switchable_cold.tier.find_manifest(manifest.name) == manifest
    migrator.close()


def test_a_commit_whose_attempt_is_pruned_while_it_waits_ends_at_once(
    switchable_cold: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed job uploads and marks X, then another migrator commits X and the cold
    policy prunes it (marks and all) before the job lists the marks: the job ends as
    delivered, at once, and X is not committed again in cold (the old one polled for its
    own mark until commit_timeout while the queue waited behind it)."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    x, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    gate = Gate(tmp_path / "gate")
    for key, value in gate.env.items():
        monkeypatch.setenv(key, value)
    faults.arm("migrator.before_marks_listing", "block")  # the first commit to get there
    resumed = Migrator(hot, cold, FAST)
    assert resumed.submit_checkpoint(x)
    gate.wait_reached("migrator.before_marks_listing")
    store = Store(str(tmp_path / "hot"), switchable_cold.url, cold_options=switchable_cold.options)
    assert [s.state for s in migrate_pending(store, config=FAST)] == [MigrationState.COMMITTED]
    y, _ = save_ranks(1, str(tmp_path / "hot"), step=2)
    assert [s.name for s in migrate_pending(store, config=FAST)] == [y.name]
    assert prune_tier(switchable_cold.tier, keep_last(1)).deleted == (x.name,)
    started = time.monotonic()
    gate.release("migrator.before_marks_listing")
    assert resumed.wait(10), "the commit waited for a mark the prune had deleted"
    assert time.monotonic() - started < 10
    assert [s.state for s in resumed.status() if s.name == x.name] == [MigrationState.COMMITTED]
    assert switchable_cold.tier.find_manifest(x.name) is None  # pruned by policy, not put back
    resumed.close()


def test_a_commit_whose_marks_someone_deleted_fails_at_once(
    switchable_cold: Cold, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marks gone and the attempt never delivered (a careless gc, a person): the job
    fails at once, retryable, and the checkpoint stays pending."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    x, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    gate = Gate(tmp_path / "gate")
    for key, value in gate.env.items():
        monkeypatch.setenv(key, value)
    faults.arm("migrator.before_marks_listing", "block")
    migrator = Migrator(hot, cold, FAST)
    migrator.submit_commit(x, 0)
    gate.wait_reached("migrator.before_marks_listing")
    for info in list(switchable_cold.tier.backend.list(layout.upload_prefix(x.name, x.attempt))):
        switchable_cold.tier.backend.delete(info.key)
    gate.release("migrator.before_marks_listing")
    assert migrator.wait(10), "the commit waited for a mark someone had deleted"
    [status] = [s for s in migrator.status() if s.name == x.name]
    assert status.state is MigrationState.FAILED and "were deleted" in (status.error or ""), status
    assert migrator.to_retry() == {x.name}
    migrator.retry_failed()
    committed(migrator, x)
    migrator.close()


def test_a_commit_waiting_for_a_rank_that_never_marks_never_holds_the_queue(
    switchable_cold: Cold, tmp_path: Path
) -> None:
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    stuck, _ = save_ranks(2, str(tmp_path / "hot"), step=1)  # rank 1's files: never uploaded
    later, _ = save_ranks(1, str(tmp_path / "hot"), step=2)
    migrator = Migrator(hot, cold, FAST)
    migrator.submit_commit(stuck, 0, fresh=True)  # waits for rank 1's mark (commit_timeout 60 s)
    migrator.submit_commit(later, 0, fresh=True)
    deadline = time.monotonic() + 20
    while switchable_cold.tier.find_manifest(later.name) is None:
        assert time.monotonic() < deadline, (
            f"{later.name} queued behind a commit that waits: {migrator.status()}"
        )
        time.sleep(0.05)
    [waiting] = [s for s in migrator.status() if s.name == stuck.name]
    assert waiting.state is MigrationState.UPLOADING  # still waiting, and nothing behind it
    migrator.stop()
    assert migrator.wait(10)
    migrator.close()


def test_undelivered_names_only_what_is_really_pending(switchable_cold: Cold, tmp_path: Path) -> None:
    """X's job failed (the cold tier refused); another migrator delivered X since and the
    cold policy pruned it. close() used to raise MigrationFailed for X, "in no tier"."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    x, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    trainer = Migrator(hot, cold, FAST)
    switchable_cold.down()
    trainer.submit_commit(x, 0, fresh=True)
    assert trainer.wait(30)
    assert [s.state for s in trainer.status()] == [MigrationState.FAILED]
    switchable_cold.up()
    assert set(undelivered([trainer], switchable_cold.tier, timeout=30)) == {x.name}  # pending: named
    store = Store(str(tmp_path / "hot"), switchable_cold.url, cold_options=switchable_cold.options)
    migrate_pending(store, config=FAST)
    assert undelivered([trainer], switchable_cold.tier, timeout=30) == {}  # in cold now
    y, _ = save_ranks(1, str(tmp_path / "hot"), step=2)
    migrate_pending(store, config=FAST)
    assert prune_tier(switchable_cold.tier, keep_last(1)).deleted == (x.name,)
    assert undelivered([trainer], switchable_cold.tier, timeout=30) == {}  # delivered, then pruned
    trainer.close()


def test_the_breaker_lets_a_probe_through(switchable_cold: Cold, tmp_path: Path) -> None:
    """One refusal, then a healthy cold tier: the next job is attempted (a probe first),
    not failed "not attempted" for BREAKER_SECONDS, and the failed one commits on retry."""
    hot, cold = tiers(tmp_path / "hot", switchable_cold)
    x, _ = save_ranks(1, str(tmp_path / "hot"), step=1)
    y, _ = save_ranks(1, str(tmp_path / "hot"), step=2)
    migrator = Migrator(hot, cold, FAST)
    switchable_cold.down()
    migrator.submit_commit(x, 0, fresh=True)
    assert migrator.wait(30)
    switchable_cold.up()
    time.sleep(Migrator.FIRST_PROBE)
    migrator.submit_commit(y, 0, fresh=True)
    committed(migrator, y)  # 3 s after a refusal: within the old breaker's 30 s
    migrator.retry_failed()
    committed(migrator, x)
    migrator.close()


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(16384, dtype=torch.float32) * step, "step": step}


def manager(hot: Path, cold: Cold, **options: Any) -> CheckpointManager:
    given = options.pop("retention", Retention())
    return CheckpointManager(
        Store(str(hot), cold.url, cold_options=cold.options),
        migration=FAST,
        retention=dataclasses.replace(given, hot_min_free=None),
        **options,
    )


def test_close_spends_its_deadline_trying_after_a_blip(switchable_cold: Cold, tmp_path: Path) -> None:
    """The cold tier refuses the run's migration, then is healthy: close() tries again and
    delivers (it gave up after 0.4 s of its 300, raising MigrationFailed)."""
    run = manager(
        tmp_path / "hot", switchable_cold, options=ManagerOptions(close_timeout=60), preemption=False
    )
    switchable_cold.down()
    run.save(1, state(1))
    run.wait(migrations=False)
    assert run._maintenance.migrators()[0].wait(30)
    assert run.health().migrations_failed
    switchable_cold.up()
    run.close()  # raised MigrationFailed
    assert switchable_cold.tier.find_manifest(layout.default_name(1)) is not None


def test_close_with_the_cold_tier_down_still_ends_and_names_what_it_left(
    switchable_cold: Cold, tmp_path: Path
) -> None:
    """The other side: a cold tier that stays down is tried until the deadline, or given up
    on after 10 s without an answer; close() then raises naming the checkpoint."""
    run = manager(
        tmp_path / "hot", switchable_cold, options=ManagerOptions(close_timeout=15), preemption=False
    )
    switchable_cold.down()
    run.save(1, state(1))
    started = time.monotonic()
    with pytest.raises(MigrationFailed) as raised:
        run.close()
    assert time.monotonic() - started < 15 + 10
    assert raised.value.checkpoints == (layout.default_name(1),)


def test_the_preemption_push_retries_a_cold_tier_that_comes_back(
    switchable_cold: Cold, tmp_path: Path
) -> None:
    """The cold tier refuses the notice's migration and is back 2 s later, well inside the
    grace period: the push tries again and commits (it gave up with 29.9 s of 30 left)."""
    run = manager(
        tmp_path / "hot", switchable_cold, save_every=100, preemption=PreemptionOptions(grace_seconds=20)
    )
    switchable_cold.down()
    back = threading.Timer(2.0, switchable_cold.up)
    back.start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.save(3, state(3)) and run.preempted
    finally:
        back.join()
    report = run.preemption
    assert report is not None and report.cold == "committed", report
    assert report.seconds_left > 0
    run.close()
    assert switchable_cold.tier.find_manifest(layout.default_name(3)) is not None


def test_a_manager_resumes_no_checkpoint_another_live_manager_is_delivering(
    switchable_cold: Cold, tmp_path: Path
) -> None:
    """Two managers on one directory: neither queues a job for the other's checkpoints
    saved after it started (their own job delivers them); the one that starts later does
    finish what it found pending at its start."""
    hot = tmp_path / "hot"
    left_behind, _ = save_ranks(1, str(hot), step=1)  # a killed run's: pending
    first = manager(hot, switchable_cold, preemption=False, retention=Retention(hot=keep_last(10)))
    first.wait()
    assert switchable_cold.tier.find_manifest(left_behind.name) is not None  # resumed at start
    theirs, _ = save_ranks(1, str(hot), step=5)  # another job's save, its migration still to come
    first.save(2, state(2))
    first.wait()
    mine = {s.name for s in first._maintenance.migrators()[0].status()}
    assert theirs.name not in mine, "migrated another live job's checkpoint"
    first.close()
