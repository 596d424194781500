"""GC never deletes what it cannot read, and damaged marks and leases never wedge prune or GC."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers import saved

from tierstore import Store, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last

OLD = time.time() - 7 * 3600  # older than a lease's default TTL (6 h)


def put(root: str, key: str, data: bytes, *, mtime: float | None = None) -> Path:
    path = Path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_a_torn_manifest_is_damage_not_garbage(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    torn = saved(hot, 1)
    saved(hot, 2)
    # A second, dead attempt of the torn checkpoint: the torn manifest may name either.
    other = layout.attempt_prefix(torn.name, layout.new_attempt())
    shutil.copytree(Path(hot, layout.attempt_prefix(torn.name, torn.attempt)), Path(hot, other))
    key = Path(hot, layout.manifest_key(torn.name))
    key.write_bytes(key.read_bytes()[:60])
    report = collect_garbage(hot, grace=0, dry_run=False)
    assert report.garbage == ()
    assert [(d.key, d.tier.startswith("hot")) for d in report.damaged] == [
        (layout.manifest_key(torn.name), True)
    ]
    assert "invalid manifest" in report.damaged[0].error
    assert Path(hot, layout.attempt_prefix(torn.name, torn.attempt), "__0_0.distcp").exists()
    assert Path(hot, other, "__0_0.distcp").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore", "gc", "--hot", hot, "--grace", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and f"DAMAGED  hot {hot}  {layout.manifest_key(torn.name)}" in proc.stdout


def test_an_oversized_manifest_is_damage_too(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    big = saved(hot, 1)
    saved(hot, 2)
    os.truncate(Path(hot, layout.manifest_key(big.name)), 65 << 20)  # sparse: over the 64 MiB limit
    report = collect_garbage(hot, grace=0, dry_run=False)
    assert report.garbage == () and [d.key for d in report.damaged] == [layout.manifest_key(big.name)]
    assert Path(hot, layout.attempt_prefix(big.name, big.attempt), "__0_0.distcp").exists()
    assert [c.step for c in list_checkpoints(hot)] == [2]


def test_oversized_and_unreadable_leases_never_wedge_prune_or_gc(tmp_path: Path, caplog) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        saved(hot, step)
    name1, name2 = layout.default_name(1), layout.default_name(2)
    unreadable = put(hot, layout.lease_key(name1, uuid.uuid4().hex), b"not json", mtime=OLD)
    oversized = put(hot, layout.lease_key(name2, uuid.uuid4().hex), b" " * (1 << 20))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deleted == (name1,)  # its unreadable lease counts from its mtime: expired
    assert report.deferred == (name2,)  # a fresh lease, even unreadable, is honoured
    assert [c.step for c in list_checkpoints(hot)] == [3]
    assert not Path(hot, layout.checkpoint_prefix(name1)).exists()
    assert Path(hot, layout.checkpoint_prefix(name2)).exists()
    for path in (unreadable, oversized):
        assert any(
            str(path.relative_to(hot)) in r.getMessage() and "hot" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING
        ), path
    # The fresh oversized lease still protects step 2's data; the old unreadable one is expired.
    assert [g.key for g in find_garbage(hot, grace=0)] == [str(unreadable.relative_to(hot))]
    os.utime(oversized, (OLD, OLD))  # the load it stood for is long over
    report = collect_garbage(hot, grace=0, dry_run=False)
    assert report.failures == () and report.damaged == ()
    reasons = {g.key: g.reason for g in report.garbage}
    assert reasons[str(oversized.relative_to(hot))] == "expired lease"
    assert reasons[str(unreadable.relative_to(hot))] == "expired lease"
    assert not Path(hot, layout.checkpoint_prefix(name2)).exists()
    assert find_garbage(hot, grace=0) == []


def test_damaged_upload_marks_are_cleared_once_old(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    pending = saved(hot, 1)  # committed in hot only: its cold uploads are live
    prefix = layout.upload_prefix(pending.name, pending.attempt)
    good = put(
        cold,
        layout.upload_mark_key(pending.name, pending.attempt, 2),
        json.dumps({"rank": 2, "files": []}).encode(),
    )
    damaged = [
        put(
            cold,
            layout.upload_mark_key(pending.name, pending.attempt, 0),
            json.dumps({"rank": 3, "files": []}).encode(),
        ),  # names another rank
        put(cold, layout.upload_mark_key(pending.name, pending.attempt, 1), b'{"rank": 1, "fi'),
        put(cold, prefix + "rank-4.failed.json", b"\x00garbage"),
        put(cold, prefix + "rank-x.json", b"{}"),  # no mark has such a key
    ]
    identity = put(cold, "tierstore-store.json", json.dumps({"store_id": uuid.uuid4().hex}).encode())
    assert find_garbage(Store.of(hot, cold), grace=3600) == []  # young: perhaps still being written
    for path in (good, identity, *damaged):
        os.utime(path, (OLD, OLD))
    report = collect_garbage(Store.of(hot, cold), grace=3600, dry_run=False)
    assert sorted(g.key for g in report.garbage) == sorted(str(p.relative_to(cold)) for p in damaged)
    assert {g.reason for g in report.garbage} == {"damaged upload mark"}
    assert good.exists() and identity.exists() and report.failures == ()


def test_migrated_marks_of_both_layouts_go_with_their_checkpoint(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    kept = saved(hot, 1)
    store_id, gone = uuid.uuid4().hex, layout.new_attempt()
    # Keys spelled out: migrated/<name>/<attempt>/<store-id>.json, and the legacy
    # migrated/<name>/<attempt>.json of tierstore <= 0.1.
    marks = {
        f"migrated/{kept.name}/{kept.attempt}/{store_id}.json": False,
        f"migrated/{kept.name}/{kept.attempt}.json": False,  # legacy, committed
        f"migrated/{layout.default_name(9)}/{gone}/{store_id}.json": True,
        f"migrated/{layout.default_name(8)}/{gone}.json": True,  # legacy, pruned
        "migrated/notes.txt": False,  # not a mark: not ours to judge
    }
    for key in marks:
        put(hot, key, b"{}", mtime=OLD)
    garbage = find_garbage(hot, grace=0)
    assert sorted(g.key for g in garbage) == sorted(k for k, doomed in marks.items() if doomed)
    assert {g.reason for g in garbage} == {"migrated mark of a pruned checkpoint"}
