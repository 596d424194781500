"""Prune, gc and status at scale: deletes in batches (one request per 1,000 keys where the
backend batches), manifests read as roots only and parsed once, a reused name seen fresh.

Checkpoints of many ranks are built here file by file (tiny files, a real two-level
manifest published through the tier), and every request goes through a backend that
forwards each call to the local backend and counts it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierstore import collect_garbage, list_checkpoints
from tierstore.errors import StorageError
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.prune import prune, prune_node_local, prune_tier
from tierstore.lifecycle.retention import keep_all, keep_last
from tierstore.migration.status import migration_status
from tierstore.storage.backend import ObjectInfo
from tierstore.storage.checksum import crc32c_update
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Store, Tier


class CountingBackend(LocalBackend):
    """The local backend, counting requests: a batch delete is one, the single deletes it is
    made of are not; reads are counted by what they read (a manifest root or part)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url.replace("counting://", "file://", 1), **options)
        self.calls: Counter[str] = Counter()
        self._batch = threading.local()

    def delete(self, key: str) -> None:
        if not getattr(self._batch, "on", False):
            self.calls["delete"] += 1
        super().delete(key)

    def delete_if(self, key: str, version: str) -> bool:
        self.calls["delete"] += 1  # one request, as a conditional delete is on S3 and GCS
        return super().delete_if(key, version)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.calls["delete_many"] += 1
        self._batch.on = True
        try:
            super().delete_many(keys)
        finally:
            self._batch.on = False

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.calls["list"] += 1
        return super().list(prefix)

    def read_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        if layout.parse_manifest_key(key) is not None:
            self.calls["read root"] += 1
        elif layout.is_manifest_part(key):
            self.calls["read part"] += 1
        return super().read_bytes(key, limit=limit)


@pytest.fixture(autouse=True)
def _counting(registered_backend) -> None:
    registered_backend("counting", CountingBackend)


def calls(tier: Tier | None) -> Counter[str]:
    assert tier is not None and isinstance(tier.backend, CountingBackend)
    return tier.backend.calls


def commit(
    tier: Tier,
    step: int,
    ranks: Iterable[int] | int,
    *,
    world: int | None = None,
    part_ranks: int = 1000,
    files_here: Iterable[int] | None = None,
) -> Manifest:
    """Commit a checkpoint of one tiny file per rank (plus ``.metadata``) in ``tier``, its
    manifest two-level past ``part_ranks`` ranks; ``files_here``: the ranks whose files this
    tier holds (a node's hot root), all by default."""
    ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
    name, attempt = layout.default_name(step), layout.new_attempt()
    here = set(ranks if files_here is None else files_here)
    root = Path(tier.url.removeprefix("counting://"))
    entries = []
    for rank in [0, *ranks]:
        path = layout.METADATA_FILE if not entries else layout.data_file_name(rank, 0)
        data = f"{name} {path}".encode()
        entries.append(FileEntry(path, len(data), crc32c_update(0, data), rank))
        if rank in here or path == layout.METADATA_FILE:
            target = root / tier.file_key(name, attempt, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)  # setup only: what a save leaves, written fast
    manifest = Manifest(
        name, step, attempt, world or max([0, *ranks]) + 1, time.time(), entries, part_ranks=part_ranks
    )
    tier.publish_manifest(manifest)
    return manifest


def stored(root: Path, manifest: Manifest) -> list[Path]:
    return [
        p for p in (root / layout.attempt_prefix(manifest.name, manifest.attempt)).rglob("*") if p.is_file()
    ]


def test_prune_deletes_a_big_checkpoint_in_batches(tmp_path: Path) -> None:
    root = tmp_path / "hot"
    tier = Store(f"counting://{root}").hot
    assert tier is not None
    doomed = [commit(tier, step, 1500, part_ranks=500) for step in (1, 2)]
    newest = commit(tier, 3, 4, part_ranks=2)
    assert all(len(m.parts) == 3 for m in doomed) and len(newest.parts) == 2
    tier = Store(f"counting://{root}").hot  # another process: no manifest cached
    assert tier is not None
    report = prune_tier(tier, keep_last(1))
    assert set(report.deleted) == {m.name for m in doomed}
    assert report.bytes_freed == sum(m.total_size for m in doomed)
    # Per checkpoint: un-publish (one delete), then 1,504 keys (files and parts) in 2 batches.
    # One delete per file, as before, would be 3,000 requests.
    assert calls(tier)["delete"] == 2 and calls(tier)["delete_many"] == 4, calls(tier)
    # The doomed attempts' keys come from listing them, not from reading their parts.
    assert calls(tier)["read part"] == 0, calls(tier)
    assert all(stored(root, m) == [] for m in doomed)
    assert len(stored(root, newest)) == 5 + 2  # four ranks' files, .metadata, two parts
    assert [c.step for c in list_checkpoints(Store(f"counting://{root}"))] == [3]


def test_gc_deletes_in_batches_and_keeps_parts_a_root_names(tmp_path: Path) -> None:
    root = tmp_path / "hot"
    tier = Store(f"counting://{root}").hot
    assert tier is not None
    dead = commit(tier, 1, 1100, part_ranks=5000)
    tier.backend.delete(layout.manifest_key(dead.name))  # a pruned checkpoint's leftovers
    kept = commit(tier, 2, 6, part_ranks=2)
    calls(tier).clear()
    report = collect_garbage(Store.of_tiers(tier, None), grace=0, dry_run=False)
    assert {g.reason for g in report.garbage} == {"attempt named by no manifest"}
    assert len(report.garbage) == 1101 and not report.failures
    assert calls(tier)["delete_many"] == 2 and calls(tier)["delete"] == 0, calls(tier)
    assert stored(root, dead) == []
    assert len(stored(root, kept)) == 7 + 3  # the parts are the live checkpoint's, not garbage
    assert list_checkpoints(str(root))[0].num_files == 7


def test_list_prune_and_status_read_roots_only_and_once(tmp_path: Path) -> None:
    hot_root, cold_root = tmp_path / "hot", tmp_path / "cold"
    store = Store(f"counting://{hot_root}", f"counting://{cold_root}")
    for step in (1, 2):
        manifest = commit(store.hot, step, 6, part_ranks=2)  # type: ignore[arg-type]
        assert len(manifest.parts) == 3
        store.cold.publish_manifest(manifest)  # type: ignore[union-attr]
    pending = commit(store.hot, 3, 6, part_ranks=2)  # type: ignore[arg-type]

    def reads() -> dict[str, int]:
        return {
            role: calls(t)["read root"] + calls(t)["read part"]
            for role, t in (("hot", store.hot), ("cold", store.cold))
        }

    def clear() -> None:
        calls(store.hot).clear()
        calls(store.cold).clear()

    clear()
    assert [c.tiers for c in list_checkpoints(store)] == [("hot", "cold")] * 2 + [("hot",)]
    assert [c.num_files for c in list_checkpoints(store)] == [7] * 3
    assert calls(store.hot)["read part"] == calls(store.cold)["read part"] == 0
    statuses = migration_status(store)
    assert [s.state.value for s in statuses] == ["committed", "committed", "pending"]
    reports = prune(store, hot_policy=keep_all(), cold_policy=keep_all())
    assert all(not r.deleted and not r.errors for r in reports)
    assert calls(store.hot)["read part"] == calls(store.cold)["read part"] == 0, reads()
    # Nothing changed: a second round reads no manifest at all.
    clear()
    list_checkpoints(store)
    migration_status(store)
    prune(store, hot_policy=keep_all(), cold_policy=keep_all())
    assert reads() == {"hot": 0, "cold": 0}
    # A name deleted and committed again (another attempt, other ranks) is seen fresh.
    store.hot.backend.delete(layout.manifest_key(pending.name))  # type: ignore[union-attr]
    again = commit(store.hot, 3, range(2, 8), part_ranks=2)  # type: ignore[arg-type]
    listed = {c.name: c for c in list_checkpoints(store)}
    assert listed[again.name].attempt == again.attempt != pending.attempt
    status = {s.name: s for s in migration_status(store)}[again.name]
    assert status.attempt == again.attempt and status.state.value == "pending"


def test_node_local_prune_lists_its_files_and_reads_no_part(tmp_path: Path) -> None:
    node, cold_root = tmp_path / "node1", tmp_path / "cold"
    store = Store(f"counting://{node}", f"counting://{cold_root}")
    hot, cold = store.hot, store.cold
    assert hot is not None and cold is not None
    checkpoints = []
    for step in (1, 2, 3):  # 12 ranks; this node holds the files of ranks 4-7
        manifest = commit(cold, step, 12, part_ranks=4, files_here=())
        commit_files_only(hot, manifest, ranks=range(4, 8))
        checkpoints.append(manifest)
    calls(hot).clear()
    calls(cold).clear()
    report = prune_node_local(hot, cold, keep_last(1))
    assert set(report.deleted) == {m.name for m in checkpoints[:2]}
    assert report.bytes_freed == sum(f.size for m in checkpoints[:2] for f in m.files if 4 <= f.rank < 8)
    assert calls(cold)["read part"] == 0 and calls(hot)["read part"] == 0
    assert calls(hot)["delete"] == 0 and calls(hot)["delete_many"] == 2, calls(hot)
    assert [len(stored(node, m)) for m in checkpoints] == [0, 0, 4]


def commit_files_only(tier: Tier, manifest: Manifest, ranks: Iterable[int]) -> None:
    """Write ``ranks``' files of ``manifest`` into ``tier`` as a node-local save leaves them."""
    root = Path(tier.url.removeprefix("counting://"))
    for rank in ranks:
        for entry in manifest.files_of_rank(rank):
            target = root / tier.file_key(manifest.name, manifest.attempt, entry.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f"{manifest.name} {entry.path}".encode())


def test_gc_keeps_an_attempt_whose_part_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "hot"
    tier = Store(f"counting://{root}").hot
    assert tier is not None
    manifest = commit(tier, 1, 6, part_ranks=2)
    part = root / tier.file_key(manifest.name, manifest.attempt, manifest.parts[1].path)
    part.write_bytes(part.read_bytes().replace(b'"size"', b'"SIZE"', 1))
    stray = root / tier.file_key(manifest.name, manifest.attempt, "stray.bin")
    stray.write_bytes(b"not in any manifest")
    report = collect_garbage(str(root), grace=0, dry_run=False)
    assert report.garbage == () and [f.key for f in report.failures] == [
        layout.attempt_prefix(manifest.name, manifest.attempt)
    ]
    assert "part" in report.failures[0].error
    assert len(stored(root, manifest)) == 7 + 3 + 1  # its files cannot be known: all kept


def test_node_local_prune_goes_on_past_a_failing_checkpoint_and_defers_a_leased_one(tmp_path: Path) -> None:
    """One checkpoint whose files cannot be deleted is reported and the others go on; one a
    load holds a lease on keeps its files and is reported deferred, not deleted (issue 22)."""
    from tierstore.tiers import leases

    node, cold_root = tmp_path / "node1", tmp_path / "cold"
    store = Store(f"counting://{node}", f"counting://{cold_root}")
    hot, cold = store.hot, store.cold
    assert hot is not None and cold is not None
    checkpoints = []
    for step in (1, 2, 3, 4):
        manifest = commit(cold, step, 4, files_here=())
        commit_files_only(hot, manifest, ranks=range(2, 4))
        checkpoints.append(manifest)
    failing, leased = checkpoints[0], checkpoints[1]
    real = hot.backend.delete_many

    def refusing(keys: Iterable[str]) -> None:  # the disk refuses this checkpoint's files
        keys = list(keys)
        if any(failing.attempt in key for key in keys):
            raise StorageError("EIO: input/output error", key=keys[0], tier=hot.label)
        real(keys)

    hot.backend.delete_many = refusing  # type: ignore[method-assign]
    assert leases.take(hot, leased.name) is not None
    report = prune_node_local(hot, cold, keep_last(1))
    assert [e.split(":")[0] for e in report.errors] == [failing.name]
    assert report.deferred == (leased.name,)
    assert set(report.deleted) == {checkpoints[2].name}
    assert stored(node, failing) and stored(node, leased)
    assert not stored(node, checkpoints[2]) and stored(node, checkpoints[3])
