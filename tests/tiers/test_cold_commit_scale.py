"""The cold commit at scale (issue 15, item 2): requests per rank upload and per commit.

W simulated ranks of F files each, every one migrated by the real :class:`Migrator` into a
real cold tier (a local directory, or the S3 plugin on the moto server), counted by a
forwarding wrapper around the cold backend (every call reaches the real backend). On S3
the HTTP requests themselves are counted too, from botocore's ``before-send`` event.

Proof that the counts fail with the old code path: run this file with HEAD's
``tierstore/migration/migrator.py`` and ``marks.py`` (2W requests per polling round, a HEAD per
file at the commit, W single deletes; 3 + 4F requests per rank upload).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.migrator import Job, MigrationOptions, MigrationState, Migrator
from tierstore.migration.status import migrate_pending
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers import marks
from tierstore.tiers.tier import Store, Tier

W, F = 64, 2
FAST = MigrationOptions(
    poll_interval=0.01, commit_timeout=0.2, retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.01)
)


class CountingBackend(Backend):
    """Forwards every call to ``inner`` and counts the requests an object store sends for
    it: a list is a request per 1,000 keys, a batch delete a request per 1,000 keys, a
    verified write two (the PUT, and its check), anything else one."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner.url)
        self.inner, self.label = inner, inner.label
        self.spread_keys = inner.spread_keys  # type: ignore[misc]
        self.counts: Counter[str] = Counter()
        self.read: list[str] = []  # the keys GET asked for

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self.counts["write"] += 2
        return self.inner.open_write(key)

    def open_read(self, key: str) -> BinaryIO:
        self.counts["get"] += 1
        self.read.append(key)
        return self.inner.open_read(key)

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        self.counts["get"] += 1
        self.read.append(key)
        return self.inner.open_range(key, offset, length)

    def read_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        self.counts["get"] += 1
        self.read.append(key)
        return self.inner.read_bytes(key, limit=limit)

    def publish(self, key: str, data: bytes) -> None:
        self.counts["publish"] += 1
        self.inner.publish(key, data)

    def stat(self, key: str) -> ObjectInfo:
        self.counts["head"] += 1
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        infos = list(self.inner.list(prefix))
        self.counts["list"] += max(1, math.ceil(len(infos) / 1000))
        return iter(infos)

    def delete(self, key: str) -> None:
        self.counts["delete"] += 1
        self.inner.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.counts["delete"] += math.ceil(len(keys) / 1000)
        self.inner.delete_many(keys)

    def close(self) -> None:
        self.inner.close()


def counted(tier: Tier) -> CountingBackend:
    wrapper = CountingBackend(tier.backend)
    tier._backend = wrapper
    return wrapper


def http_requests(tier: Tier) -> list[str]:
    """Every HTTP request the S3 plugin under ``tier`` sends from now on."""
    sent: list[str] = []
    inner = tier.backend.inner if isinstance(tier.backend, CountingBackend) else tier.backend
    inner.fs.s3.meta.events.register(  # type: ignore[attr-defined]
        "before-send.s3", lambda request, **_: sent.append(request.method)
    )
    return sent


@pytest.fixture(params=["local", "s3"])
def cold_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "local":
        yield Tier("cold", str(tmp_path / "cold"))
        return
    pytest.importorskip("tierstore_s3")
    bucket = request.getfixturevalue("s3_bucket")
    options = {
        "endpoint_url": request.getfixturevalue("s3_endpoint"),
        "key": "testing",
        "secret": "testing",
        "region": "us-west-2",
    }
    tier = Tier("cold", f"s3://{bucket}/run", options)
    yield tier
    tier.backend.close()


def write_attempt(hot: Tier, world: int = W, per_rank: int = F, **options: Any) -> Manifest:
    """A committed hot checkpoint of ``world`` ranks, ``per_rank`` small files each, and
    rank 0's ``.metadata``: what ``TieredWriter`` leaves, without DCP (``options``: the
    Manifest's, ``part_ranks`` say)."""
    name, attempt = layout.default_name(1), layout.new_attempt(grouped=True)  # as raw saves
    files = []

    def put(path: str, rank: int, data: bytes) -> None:
        with hot.backend.open_write(hot.file_key(name, attempt, path)) as out:
            out.write(data)
        files.append(FileEntry(path, len(data), crc32c_update(0, data), rank))

    for rank in range(world):
        for index in range(per_rank):
            put(layout.data_file_name(rank, index), rank, f"rank {rank} file {index} ".encode() * 4)
    put(layout.METADATA_FILE, 0, b"metadata of the attempt")
    manifest = Manifest(
        name=name,
        step=1,
        attempt=attempt,
        world_size=world,
        created=time.time(),
        files=sorted(files, key=lambda f: (f.rank, f.path)),
        producer="test",
        **options,
    )
    hot.publish_manifest(manifest)
    return manifest


def rank_job(manifest: Manifest, rank: int, *, fresh: bool = True, commit: bool = False) -> Job:
    return Job.of(manifest, rank, commits=commit, fresh=fresh)


def upload_ranks(migrator: Migrator, manifest: Manifest, ranks: Iterable[int]) -> None:
    for rank in ranks:
        job = rank_job(manifest, rank)
        migrator.run(job)
        assert job.state is MigrationState.UPLOADED, job.error


def spread_prefixes(tier: Tier, manifest: Manifest) -> int:
    """How many data prefixes the attempt's files live under in ``tier``."""
    return len(
        {tier.file_key(manifest.name, manifest.attempt, f.path).rsplit("/", 1)[0] for f in manifest.files}
    )


def test_fresh_uploads_and_the_commit_stay_within_their_request_budgets(
    tmp_path: Path, cold_tier: Tier
) -> None:
    hot = Tier("hot", str(tmp_path / "hot"))
    manifest = write_attempt(hot)
    wrapper = counted(cold_tier)
    is_s3 = wrapper.inner.scheme == "s3"
    sent = http_requests(cold_tier) if is_s3 else []
    migrator = Migrator(hot, cold_tier, FAST)
    for rank in range(W):  # each rank's own migrator, in its own process in a real job
        wrapper.counts.clear()
        sent.clear()
        upload_ranks(migrator, manifest, [rank])
        per_rank = 1 + 2 * len(manifest.files_of_rank(rank))  # PUT + verify per file, the mark
        assert wrapper.total <= per_rank, (rank, wrapper.counts)
        if is_s3:
            assert len(sent) <= per_rank, (rank, Counter(sent))
    wrapper.counts.clear()
    sent.clear()
    migrator._commit(manifest)  # every rank done: the listing's first round sees them all
    # W/64 stands for the data listing: where keys spread over hashed prefixes (S3, GCS),
    # one listing per prefix the attempt uses, one per 64 ranks (layout.file_key) plus one.
    if wrapper.spread_keys:
        assert spread_prefixes(cold_tier, manifest) <= W / 64 + 1
    budget = W / 1000 + W / 64 + 10
    assert wrapper.total <= budget, wrapper.counts
    if is_s3:
        assert len(sent) <= budget, Counter(sent)
    assert wrapper.counts["head"] == 0  # no HEAD per file, nor per mark
    assert cold_tier.find_manifest(manifest.name) == manifest
    assert list(cold_tier.backend.list(layout.upload_prefix(manifest.name, manifest.attempt))) == []


def test_tierstore_migrate_keeps_every_check_before_an_upload(tmp_path: Path) -> None:
    hot, cold = Tier("hot", str(tmp_path / "hot")), Tier("cold", str(tmp_path / "cold"))
    manifest = write_attempt(hot, world=2)
    wrapper = counted(cold)
    migrator = Migrator(hot, cold, FAST)
    job = rank_job(manifest, 1, fresh=False)
    migrator.run(job)
    assert job.state is MigrationState.UPLOADED
    # the rank's marks listed, a verified copy looked for per file, a failure mark cleared
    assert wrapper.counts["list"] >= 1 and wrapper.counts["head"] >= F
    assert wrapper.counts["delete"] >= 1
    wrapper.counts.clear()
    migrator.run(rank_job(manifest, 1, fresh=False))  # done already: nothing uploaded again
    assert wrapper.counts["write"] == 0 and wrapper.counts["publish"] == 0


@pytest.mark.parametrize("damage", ["missing", "wrong size"])
def test_a_forged_mark_never_commits_a_missing_or_resized_file(
    tmp_path: Path, cold_tier: Tier, damage: str
) -> None:
    hot = Tier("hot", str(tmp_path / "hot"))
    manifest = write_attempt(hot, world=8, part_ranks=4)  # a two-level manifest, 2 parts
    migrator = Migrator(hot, cold_tier, FAST)
    upload_ranks(migrator, manifest, [r for r in range(8) if r != 5])
    victim = manifest.files_of_rank(5)[0]
    if damage == "wrong size":  # rank 5's other file is fine; this one is cut short
        cold_tier.backend.publish(cold_tier.file_key(manifest.name, manifest.attempt, victim.path), b"short")
    # The right key for rank 5 (it names rank 5's files), but content no upload wrote.
    key = marks.upload_mark_key(manifest.name, manifest.attempt, 5, manifest.files_of_rank(5))
    cold_tier.backend.publish(key, b'{"forged": true}')
    commit = rank_job(manifest, 0, commit=True)
    migrator.run(commit)
    assert commit.state is MigrationState.FAILED
    assert commit.failed_rank == 5 and commit.failed_file == victim.path
    assert cold_tier.find_manifest(manifest.name) is None  # never vouched for a hole
    # `tierstore migrate` finds the mark damaged, uploads rank 5 again and commits.
    assert migrate_pending(Store.of_tiers(hot, cold_tier), config=FAST)[0].state is MigrationState.COMMITTED
    stored = cold_tier.backend.stat(cold_tier.file_key(manifest.name, manifest.attempt, victim.path))
    assert stored.size == victim.size and cold_tier.find_manifest(manifest.name) == manifest


def test_a_mark_of_an_earlier_version_is_harmless(tmp_path: Path) -> None:
    hot, cold = Tier("hot", str(tmp_path / "hot")), Tier("cold", str(tmp_path / "cold"))
    manifest = write_attempt(hot, world=3)
    migrator = Migrator(hot, cold, FAST)
    upload_ranks(migrator, manifest, [0, 1])
    # Rank 2 never uploaded; a mark where earlier versions kept it says it did.
    body = marks._mark_body(2, manifest.files_of_rank(2))
    cold.backend.publish(layout.upload_mark_key(manifest.name, manifest.attempt, 2), body)
    commit = rank_job(manifest, 0, commit=True)
    migrator.run(commit)
    assert commit.state is MigrationState.FAILED and commit.failed_rank == 2
    assert "no upload mark from ranks [2]" in (commit.error or "")
    assert migrate_pending(Store.of_tiers(hot, cold), config=FAST)[0].state is MigrationState.COMMITTED
    assert cold.find_manifest(manifest.name) == manifest


def test_a_failure_mark_stops_the_wait_and_is_read_only_when_listed(tmp_path: Path) -> None:
    hot, cold = Tier("hot", str(tmp_path / "hot")), Tier("cold", str(tmp_path / "cold"))
    manifest = write_attempt(hot, world=4)
    migrator = Migrator(hot, cold, MigrationOptions(poll_interval=0.01, commit_timeout=60))
    upload_ranks(migrator, manifest, [1, 3])  # rank 0: with the commit, as the writer does
    marks.publish_failure(cold, manifest.name, manifest.attempt, 2, "__2_0.distcp", "disk on fire")
    wrapper = counted(cold)
    commit = rank_job(manifest, 0, commit=True)
    migrator.run(commit)  # fails at once, not after the 60 s timeout
    assert commit.state is MigrationState.FAILED and commit.failed_rank == 2
    assert "disk on fire" in (commit.error or "")
    uploads = layout.upload_prefix(manifest.name, manifest.attempt)
    assert [key for key in wrapper.read if key.startswith(uploads)] == [
        layout.failed_mark_key(manifest.name, manifest.attempt, 2)
    ]  # no upload mark read


def test_marks_count_only_for_the_files_their_key_names(tmp_path: Path) -> None:
    cold = Tier("cold", str(tmp_path / "cold"))
    name, attempt = layout.default_name(3), layout.new_attempt()
    files = (FileEntry("__1_0.distcp", 10, 7, 1),)
    other = (FileEntry("__1_0.distcp", 11, 7, 1),)
    marks.publish_upload_mark(cold, name, attempt, 1, files)
    marks.publish_failure(cold, name, attempt, 4, None, "x")
    listing = marks.list_marks(cold, name, attempt)
    assert listing.marked(1, marks.files_digest(files))
    assert not listing.marked(1, marks.files_digest(other)) and listing.failed == {4}
    assert marks.read_upload_mark(cold, name, attempt, 1, files) == files
    assert marks.read_upload_mark(cold, name, attempt, 1) == files  # by listing the rank's marks
    assert marks.read_upload_mark(cold, name, attempt, 1, other) is None
    key = marks.upload_mark_key(name, attempt, 1, files)
    assert layout.parse_upload_key(key) == (name, attempt, 1, False)
    assert layout.upload_mark_digest(key) == marks.files_digest(files)
    assert not marks.is_damaged(cold, name, attempt, 1, failed=False, key=key)
    cold.backend.delete(key)
    cold.backend.publish(key, marks._mark_body(1, other))  # lists other files than its key names
    assert marks.is_damaged(cold, name, attempt, 1, failed=False, key=key)
    marks.clear_upload_marks(cold, name, attempt, listing.keys)
    assert list(cold.backend.list(layout.upload_prefix(name, attempt))) == []
