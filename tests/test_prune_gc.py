"""Pruning in the safe order, SIGKILL at each prune fault point, garbage collection."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, list_checkpoints
from tierstore.commit import layout
from tierstore.lifecycle import leases
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import prune, prune_tier
from tierstore.lifecycle.retention import keep_last, keep_steps
from tierstore.tiers.migrator import MigrationConfig
from tierstore.tiers.status import migrate_pending, wait_for_migrations
from tierstore.tiers.tier import Tier


def state_for(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "extra": {"step": step}}


def save(hot: str, step: int, cold: str | None = None) -> None:
    dcp.save(state_for(step), storage_writer=TieredWriter(hot, cold, step=step,
                                                          migration=MigrationConfig(poll_interval=0.01)))


def loads_bit_exact(hot: str | None, cold: str | None, step: int) -> bool:
    target = {"w": torch.zeros(64, 64), "extra": {"step": -1}}
    dcp.load(target, storage_reader=TieredReader(hot, cold, step=step, lease=False))
    return torch.equal(target["w"], state_for(step)["w"]) and target["extra"]["step"] == step


def assert_every_listed_checkpoint_loads(hot: str | None, cold: str | None = None) -> None:
    for info in list_checkpoints(hot, cold):
        for tier in info.tiers:  # each tier's copy on its own: nothing listed is missing data
            assert loads_bit_exact(hot if tier == "hot" else None, cold if tier == "cold" else None,
                                   info.step), (info, tier)


def test_prune_keeps_policy_set_and_newest(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3, 4, 5):
        save(hot, step)
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
        save(hot, step)
    [report] = prune(hot, hot_policy=keep_last(1), dry_run=True)
    assert report.dry_run and len(report.deleted) == 2 and report.bytes_freed > 0
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3]


def test_hot_checkpoint_pending_cold_is_never_pruned(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold)
    wait_for_migrations(hot, cold, timeout=30)
    for step in (2, 3):
        save(hot, step)  # no cold tier given: these are pending in cold
    [hot_report, _] = prune(hot, cold, hot_policy=keep_last(1), cold_policy=keep_last(5))
    assert hot_report.deleted == (layout.default_name(1),)  # safe in cold already
    assert set(hot_report.protected) == {layout.default_name(2)}
    assert [c.step for c in list_checkpoints(hot)] == [2, 3]


def test_a_leased_checkpoint_keeps_its_data_until_gc(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        save(hot, step)
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
    save(hot, 1)
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


@pytest.mark.parametrize("point", ["prune.before_unpublish", "prune.after_unpublish",
                                   "prune.after_file_delete", "prune.after_file_delete@2",
                                   "prune.before_unpublish@2"])
def test_sigkill_during_prune(tmp_path: Path, point: str) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        save(hot, step)
    proc = subprocess.run([sys.executable, "-c", PRUNE_SCRIPT, hot], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TIERSTORE_FAULTS": f"{point}=kill"})
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


def test_gc_collects_only_old_unreferenced_debris(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold)
    wait_for_migrations(hot, cold, timeout=30)
    save(hot, 2)  # pending in cold; its hot files are referenced
    dead = Path(hot, layout.attempt_prefix("step-0000000009", "20260101T000000Z-deadbeef"))
    dead.mkdir(parents=True)
    (dead / "__0_0.distcp").write_bytes(b"x" * 100)
    Path(hot, layout.MANIFEST_DIR, ".step-0000000009.json.tmp-abc").write_bytes(b"{")
    # Cold uploads of a pending checkpoint (only its hot manifest exists) are not garbage.
    stray = Path(cold, layout.file_key("step-0000000002", Tier("hot", hot).find_manifest("step-0000000002").attempt, "__0_0.distcp"))
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"partial upload")
    now = time.time()
    assert find_garbage(hot, cold, grace=3600, now=now) == []  # all too young
    found = {(g.key, g.reason) for g in find_garbage(hot, cold, grace=0, now=now + 1)}
    assert found == {
        (f"{layout.attempt_prefix('step-0000000009', '20260101T000000Z-deadbeef')}__0_0.distcp",
         "attempt named by no manifest"),
        ("manifests/.step-0000000009.json.tmp-abc", "leftover publish temporary"),
    }, found
    dry = collect_garbage(hot, cold, grace=0, now=now + 1)
    assert not dry.deleted and dead.exists()
    collect_garbage(hot, cold, grace=0, now=now + 1, dry_run=False)
    assert not dead.exists() and stray.exists()
    assert_every_listed_checkpoint_loads(hot, cold)


def test_gc_removes_upload_marks_once_committed(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold)
    wait_for_migrations(hot, cold, timeout=30)
    assert not any(Path(cold, layout.UPLOAD_DIR).rglob("*.json"))  # the migrator cleaned up
    # A migrator killed right after the cold commit leaves its mark behind:
    manifest = Tier("cold", cold).find_manifest(layout.default_name(1))
    Tier("cold", cold).backend.publish(layout.upload_mark_key(manifest.name, manifest.attempt, 0), b"{}")
    report = collect_garbage(hot, cold, grace=3600, dry_run=False)
    assert [g.reason for g in report.garbage] == ["upload mark of a committed checkpoint"]
    assert not any(Path(cold, layout.UPLOAD_DIR).rglob("*.json"))
    assert_every_listed_checkpoint_loads(hot, cold)


def test_prune_tier_on_cold_and_newest_survives(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2, 3):
        save(hot, step, cold)
    wait_for_migrations(hot, cold, timeout=30)
    report = prune_tier(Tier("cold", cold), keep_last(1))
    assert set(report.deleted) == {layout.default_name(1), layout.default_name(2)}
    assert [(c.step, c.tiers) for c in list_checkpoints(hot, cold)] == [
        (1, ("hot",)), (2, ("hot",)), (3, ("hot", "cold"))]
    assert_every_listed_checkpoint_loads(hot, cold)


def test_checkpoint_pruned_from_cold_is_not_pending_again(tmp_path: Path) -> None:
    # Regression: "pending" once meant "no cold manifest now", so a checkpoint the cold
    # policy pruned looked pending again: hot kept it forever and migrate re-uploaded it.
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2, 3):
        save(hot, step, cold)
    wait_for_migrations(hot, cold, timeout=30)
    prune(None, cold, cold_policy=keep_last(1))
    assert [(c.step, c.tiers) for c in list_checkpoints(hot, cold)] == [
        (1, ("hot",)), (2, ("hot",)), (3, ("hot", "cold"))]
    assert migrate_pending(hot, cold) == []  # nothing to re-upload
    [hot_report, _] = prune(hot, cold, hot_policy=keep_last(1), cold_policy=keep_last(1))
    assert set(hot_report.deleted) == {layout.default_name(1), layout.default_name(2)}
    assert [c.step for c in list_checkpoints(hot)] == [3]
    assert find_garbage(hot, cold, grace=0) == []  # their "migrated" marks went with them
