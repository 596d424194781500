"""Pruning in the safe order, leases that hold a checkpoint's data, SIGKILL at each prune
fault point (garbage collection: tests/lifecycle/test_gc.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_every_listed_checkpoint_loads, load, matches, save

from tierstore import ReaderOptions, Store, TieredReader, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import prune, prune_tier
from tierstore.lifecycle.retention import keep_last, keep_steps
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.status import migrate_pending, wait_for_migrations
from tierstore.testing.faults import armed_env
from tierstore.tiers import leases
from tierstore.tiers.tier import Tier

FAST = MigrationOptions(poll_interval=0.01)


def loads_bit_exact(hot: str | None, cold: str | None, step: int) -> bool:
    return matches(load(hot, cold, step=step, options=ReaderOptions(lease=False))[0], step)


def test_prune_keeps_policy_set_and_newest(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3, 4, 5):
        save(hot, step, migration=FAST)
    [report] = prune(hot, hot_policy=keep_last(2) | keep_steps(1))
    assert set(report.deleted) == {layout.default_name(s) for s in (2, 3)}
    assert [c.step for c in list_checkpoints(hot)] == [1, 4, 5]
    assert_every_listed_checkpoint_loads(hot)
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(2))).exists()  # data gone
    [report] = prune(hot, hot_policy=keep_steps())  # a policy that keeps nothing...
    assert [c.step for c in list_checkpoints(hot)] == [5]  # ...still keeps the newest
    assert report.protected == (layout.default_name(5),)


def test_dry_run_touches_nothing(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        save(hot, step, migration=FAST)
    [report] = prune(hot, hot_policy=keep_last(1), dry_run=True)
    assert report.dry_run and len(report.deleted) == 2 and report.bytes_freed > 0
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3]


def test_hot_checkpoint_pending_cold_is_never_pruned(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    for step in (2, 3):
        save(hot, step, migration=FAST)  # no cold tier given: these are pending in cold
    [hot_report, _] = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(5))
    assert hot_report.deleted == (layout.default_name(1),)  # safe in cold already
    assert set(hot_report.protected) == {layout.default_name(2)}
    assert [c.step for c in list_checkpoints(hot)] == [2, 3]


def test_a_leased_checkpoint_keeps_its_data_until_gc(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        save(hot, step, migration=FAST)
    tier = Tier("hot", hot)
    held = leases.take(tier, layout.default_name(1))  # a load in another process
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deferred == (layout.default_name(1),) and report.deleted == ()
    assert [c.step for c in list_checkpoints(hot)] == [2]  # un-published at once
    assert Path(hot, layout.checkpoint_prefix(layout.default_name(1))).exists()  # data still there
    assert find_garbage(hot, grace=0) == []  # a live lease protects the unpublished data
    held.release()
    report = collect_garbage(hot, grace=0, dry_run=False)
    assert {g.reason for g in report.garbage} == {"attempt named by no manifest"}
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(1))).exists()


def test_reader_leases_and_releases(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, migration=FAST)
    tier = Tier("hot", hot)
    reader = TieredReader(hot)
    reader.read_metadata()
    assert len(leases.live_leases(tier, layout.default_name(1))) == 1
    reader._release()
    assert leases.live_leases(tier, layout.default_name(1)) == []
    assert loads_bit_exact(hot, None, 1)
    assert not Path(hot, layout.LEASE_DIR).exists() or not any(Path(hot, layout.LEASE_DIR).rglob("*.json"))


PRUNE_SCRIPT = """
import sys
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
prune(sys.argv[1], hot_policy=keep_last(1))
print("pruned")
"""


@pytest.mark.parametrize(
    "point",
    [
        "prune.before_unpublish",
        "prune.after_unpublish",
        "prune.after_file_delete",
        "prune.after_file_delete@2",
        "prune.before_unpublish@2",
    ],
)
def test_sigkill_during_prune(tmp_path: Path, point: str) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        save(hot, step, migration=FAST)
    proc = subprocess.run(
        [sys.executable, "-c", PRUNE_SCRIPT, hot],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **armed_env(f"{point}=kill")},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    listed = [c.step for c in list_checkpoints(hot)]
    assert 3 in listed and set(listed) <= {1, 2, 3}
    assert_every_listed_checkpoint_loads(hot)  # nothing listed points at missing data
    # The next GC removes the debris of whatever was half-pruned, and nothing else.
    report = collect_garbage(hot, grace=0, dry_run=False)
    keys = {g.key for g in report.garbage}
    assert all(g.reason == "attempt named by no manifest" for g in report.garbage)
    for info in list_checkpoints(hot):
        assert not any(f"/{info.name}/" in k for k in keys)
    assert_every_listed_checkpoint_loads(hot)
    assert find_garbage(hot, grace=0) == []
    # A prune rerun converges on the policy.
    prune(hot, hot_policy=keep_last(1))
    assert [c.step for c in list_checkpoints(hot)] == [3]


def test_prune_tier_on_cold_and_newest_survives(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2, 3):
        save(hot, step, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    report = prune_tier(Tier("cold", cold), keep_last(1))
    assert set(report.deleted) == {layout.default_name(1), layout.default_name(2)}
    assert [(c.step, c.tiers) for c in list_checkpoints(Store.of(hot, cold))] == [
        (1, ("hot",)),
        (2, ("hot",)),
        (3, ("hot", "cold")),
    ]
    assert_every_listed_checkpoint_loads(hot, cold)


def test_checkpoint_pruned_from_cold_is_not_pending_again(tmp_path: Path) -> None:
    # Regression: "pending" once meant "no cold manifest now", so a checkpoint the cold
    # policy pruned looked pending again: hot kept it forever and migrate re-uploaded it.
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2, 3):
        save(hot, step, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    prune(Store(cold=cold), cold_policy=keep_last(1))
    assert [(c.step, c.tiers) for c in list_checkpoints(Store.of(hot, cold))] == [
        (1, ("hot",)),
        (2, ("hot",)),
        (3, ("hot", "cold")),
    ]
    assert migrate_pending(Store.of(hot, cold)) == []  # nothing to re-upload
    [hot_report, _] = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(1))
    assert set(hot_report.deleted) == {layout.default_name(1), layout.default_name(2)}
    assert [c.step for c in list_checkpoints(hot)] == [3]
    assert find_garbage(Store.of(hot, cold), grace=0) == []  # their "migrated" marks went with them
