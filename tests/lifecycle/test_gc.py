"""Garbage collection removes old debris nothing references, and only that (damaged
manifests, marks and leases: tests/lifecycle/test_gc_damaged.py)."""

from __future__ import annotations

import time
from pathlib import Path

from helpers import assert_every_listed_checkpoint_loads, save

from tierstore import Store
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.status import wait_for_migrations
from tierstore.tiers.tier import Tier

FAST = MigrationOptions(poll_interval=0.01)


def test_gc_collects_only_old_unreferenced_debris(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    save(hot, 2, migration=FAST)  # pending in cold; its hot files are referenced
    dead = Path(hot, layout.attempt_prefix("step-0000000009", "20260101T000000Z-deadbeef"))
    dead.mkdir(parents=True)
    (dead / "__0_0.distcp").write_bytes(b"x" * 100)
    Path(hot, layout.MANIFEST_DIR, ".step-0000000009.json.tmp-abc").write_bytes(b"{")
    # Cold uploads of a pending checkpoint (only its hot manifest exists) are not garbage.
    stray = Path(
        cold,
        layout.file_key(
            "step-0000000002", Tier("hot", hot).find_manifest("step-0000000002").attempt, "__0_0.distcp"
        ),
    )
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"partial upload")
    now = time.time()
    assert find_garbage(Store.of(hot, cold), grace=3600, now=now) == []  # all too young
    found = {(g.key, g.reason) for g in find_garbage(Store.of(hot, cold), grace=0, now=now + 1)}
    assert found == {
        (
            f"{layout.attempt_prefix('step-0000000009', '20260101T000000Z-deadbeef')}__0_0.distcp",
            "attempt named by no manifest",
        ),
        ("manifests/.step-0000000009.json.tmp-abc", "leftover publish temporary"),
    }, found
    dry = collect_garbage(Store.of(hot, cold), grace=0, now=now + 1)
    assert not dry.deleted and dead.exists()
    collect_garbage(Store.of(hot, cold), grace=0, now=now + 1, dry_run=False)
    assert not dead.exists() and stray.exists()
    assert_every_listed_checkpoint_loads(hot, cold)


def test_gc_removes_upload_marks_once_committed(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    assert not any(Path(cold, layout.UPLOAD_DIR).rglob("*.json"))  # the migrator cleaned up
    # A migrator killed right after the cold commit leaves its mark behind:
    manifest = Tier("cold", cold).find_manifest(layout.default_name(1))
    Tier("cold", cold).backend.publish(layout.upload_mark_key(manifest.name, manifest.attempt, 0), b"{}")
    report = collect_garbage(Store.of(hot, cold), grace=3600, dry_run=False)
    assert [g.reason for g in report.garbage] == ["upload mark of a committed checkpoint"]
    assert not any(Path(cold, layout.UPLOAD_DIR).rglob("*.json"))
    assert_every_listed_checkpoint_loads(hot, cold)
