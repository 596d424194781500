"""A cold commit vouches only for verified bytes (issue 22, item 2; design.md invariant 10).

An object the cold tier holds for a checkpoint can be replaced, after its rank uploaded and
verified it, by other bytes of the same size (another tool, a careless person, a store
someone else can write). A listing shows the same size, and S3 and a local directory list no
checksum, so a commit that checks sizes alone vouches for bytes nobody verified; the hot copy
is then pruned against it, and the checkpoint loads nowhere. Every kind of cold tier here:
a local directory, moto's S3 (also behind a latency proxy) and fake-gcs-server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from cold_tiers import Cold
from helpers import blank, matches, state_for
from test_cold_commit_scale import rank_job, write_attempt

from tierstore import TieredReader, TieredWriter
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last, keep_none
from tierstore.migration.migrator import Job, MigrationOptions, MigrationState, Migrator
from tierstore.migration.status import migrate_pending
from tierstore.migration.transfer import has_verified_copy
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.tiers import marks
from tierstore.tiers.tier import Store, Tier

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=5,
    retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.01),
)


def saved(hot: str, step: int, world: int = 1) -> Manifest:
    """A checkpoint in the hot tier only, as a save whose migration never ran leaves it."""
    dcp.save(state_for(step), storage_writer=TieredWriter(hot, step=step))
    manifest = Tier("hot", hot).find_manifest(f"step-{step:010d}")
    assert manifest is not None
    return manifest


def replace_same_size(cold: Cold, manifest: Manifest, entry: FileEntry) -> None:
    """Put other bytes of the same size where ``entry`` is stored in the cold tier."""
    tier = cold.tier
    key = tier.file_key(manifest.name, manifest.attempt, entry.path)
    data = bytearray(tier.backend.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    with tier.backend.open_write(key) as out:
        out.write(bytes(data))
    assert tier.backend.stat(key).size == entry.size


def loads_from_cold_alone(cold: Cold, step: int) -> bool:
    target = blank()
    dcp.load(
        target,
        storage_reader=TieredReader(Store.of(None, cold.url, cold_options=cold.direct_options), step=step),
    )
    return matches(target, step)


def test_tierstore_migrate_never_commits_an_object_replaced_after_its_upload(
    any_cold: Cold, tmp_path: Path
) -> None:
    cold = any_cold
    hot = str(tmp_path / "hot")
    manifest = saved(hot, 1)
    # A first `tierstore migrate` uploads and marks every file, then dies before its commit.
    faults.arm("migrator.before_cold_publish", "raise")
    failed = migrate_pending(Store.of(hot, cold.url, cold_options=cold.options), config=FAST)
    faults.disarm()
    assert failed[0].state is MigrationState.FAILED
    data = next(f for f in manifest.files if f.path != ".metadata")
    replace_same_size(cold, manifest, data)
    # The next one must not take the mark's word for bytes that changed since.
    done = migrate_pending(Store.of(hot, cold.url, cold_options=cold.options), config=FAST)
    assert done[0].state is MigrationState.COMMITTED, done
    assert all(has_verified_copy(cold.tier, manifest.name, manifest.attempt, f) for f in manifest.files)
    # So the hot copy may go, and the checkpoint still loads, from the cold tier alone.
    saved(hot, 2)
    migrate_pending(Store.of(hot, cold.url, cold_options=cold.options), config=FAST)
    prune(
        Store.of(hot, cold.url, cold_options=cold.options), hot_policy=keep_last(1), cold_policy=keep_last(5)
    )
    assert Tier("hot", hot).find_manifest(manifest.name) is None
    assert loads_from_cold_alone(cold, 1)


def test_the_commit_refuses_an_object_replaced_between_its_mark_and_the_commit(
    any_cold: Cold, tmp_path: Path
) -> None:
    cold = any_cold
    hot = Tier("hot", str(tmp_path / "hot"))
    manifest = write_attempt(hot, world=2)
    migrator = Migrator(hot, Tier("cold", cold.url, cold.options), FAST)
    try:
        upload = rank_job(manifest, 1)
        migrator.run(upload)  # rank 1 uploaded and verified its files, and marked them
        assert upload.state is MigrationState.UPLOADED
        victim = manifest.files_of_rank(1)[0]
        replace_same_size(cold, manifest, victim)
        commit = rank_job(manifest, 0, commit=True)
        migrator.run(commit)  # rank 0 uploads its own files, finds rank 1's mark, checks
        assert commit.state is MigrationState.FAILED, commit
        assert commit.failed_file == victim.path and "differ" in (commit.error or "")
        assert cold.tier.find_manifest(manifest.name) is None
    finally:
        migrator.close()
    # Nothing in cold vouches for it, so prune keeps the hot copy; `tierstore migrate`
    # uploads the file again and commits.
    prune(
        Store.of_tiers(hot, Tier("cold", cold.url, cold.options)),
        hot_policy=keep_none(),
        cold_policy=keep_last(5),
    )
    assert hot.find_manifest(manifest.name) is not None
    done = migrate_pending(Store.of(hot.url, cold.url, cold_options=cold.options), config=FAST)
    assert done[0].state is MigrationState.COMMITTED
    assert all(has_verified_copy(cold.tier, manifest.name, manifest.attempt, f) for f in manifest.files)


def test_an_unchanged_upload_is_committed_from_listings_alone(any_cold: Cold, tmp_path: Path) -> None:
    """The check costs nothing when nothing changed: no object is read back or HEADed."""
    cold = any_cold
    hot_root = str(tmp_path / "hot")
    manifest = saved(hot_root, 1)
    migrator = Migrator(Tier("hot", hot_root), Tier("cold", cold.url, cold.options), FAST)
    try:
        files = manifest.files_of_rank(0)
        migrator.run(Job(manifest.name, manifest.attempt, 1, 0, files, manifest.created))
        reads: list[str] = []
        backend = migrator.cold.backend
        for method in ("stat", "open_read", "open_range"):
            original = getattr(backend, method)

            def spy(key: str, *args: object, _original=original, **kwargs: object) -> object:
                reads.append(key)
                return _original(key, *args, **kwargs)

            setattr(backend, method, spy)
        listing = marks.list_marks(migrator.cold, manifest.name, manifest.attempt)
        migrator._check_in_place(manifest, {0: files}, listing)
        assert [k for k in reads if "checkpoints/" in k or "shards/" in k] == []
    finally:
        migrator.close()


def test_a_copy_replaced_while_it_is_read_back_is_not_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the store has no checksum of its own, verifying means reading back: an object
    replaced during that read is not the object that was verified."""
    from tierstore.migration import transfer

    hot_root, cold_root = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = saved(hot_root, 1)
    assert migrate_pending(Store.of(hot_root, cold_root), config=FAST)[0].state is MigrationState.COMMITTED
    cold_tier = Tier("cold", cold_root)
    entry = next(f for f in manifest.files if f.path != ".metadata")
    real = transfer.verify_file

    def verify_then_replace(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)
        key = cold_tier.file_key(manifest.name, manifest.attempt, entry.path)
        same = cold_tier.backend.read_bytes(key)
        with cold_tier.backend.open_write(key) as out:  # the same bytes, written again
            out.write(same)

    monkeypatch.setattr(transfer, "verify_file", verify_then_replace)
    assert transfer.verified_copy(cold_tier, manifest.name, manifest.attempt, entry) is None
