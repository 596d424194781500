"""Background, resumable, idempotent migration from the hot tier to the cold tier.

Protocol for one checkpoint attempt (docs/design.md invariants 9, 10, 12):

1. **Each rank** uploads the files it wrote, in the background of whatever process finished
   its part of the save. Every upload is verified: the source bytes against the manifest's
   size and CRC32C as they stream, the stored object by the cold backend. The rank then
   publishes its *upload mark* ``uploads/<name>/<attempt>/rank-<r>/<digest>.json``, whose
   key names them (:mod:`tierstore.tiers.marks`).
2. **The coordinator**, once the hot manifest is committed, uploads its own files (DCP's
   ``.metadata`` among them), waits until one listing of the marks shows every rank that
   owns files marked for exactly its files of the manifest, checks every file's presence and
   size from a listing of the attempt's data and publishes the cold manifest, exclusively:
   the cold commit. Then it deletes the marks in a batch.

Requests, W ranks of F files each, every rank done at the first look: a rank's upload of an
attempt its own writer just wrote (``fresh``) is ``1 + 2F`` (a verified write, counted as a
PUT and its check, per file, then the mark), for there can be nothing of it in the cold tier
yet; ``tierstore migrate`` keeps every check before it uploads (the mark, each file's
verified copy, a failure mark to clear). The commit is about ``W/1000`` listing pages of
marks, the data listing (one prefix, or the attempt's hashed prefixes where the backend
spreads keys), the identity read, the publish and ``W/1000`` batch deletes.

The tiers are the only durable state. A checkpoint with a hot manifest and no cold manifest
is *pending*; :func:`tierstore.tiers.status.migrate_pending` (``tierstore migrate``) finishes it
from any process, later, skipping ranks whose mark exists and files already stored intact. Failures are
retried (:mod:`tierstore.retry`), then recorded (status, log, and a failure mark
``rank-<r>.failed.json`` that stops the coordinator waiting) and never raised into training.

This module is the worker. What the marks are and when one counts is :mod:`tierstore.tiers.marks`;
which migrator a process uses, and draining it at exit, :mod:`tierstore.tiers.workers`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    ConfigError,
    IntegrityError,
    TierstoreError,
    TransientStorageError,
)
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.progress import counting
from tierstore.retry import RetryPolicy, polling
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier
from tierstore.tiers.transfer import Throttle, copy_file, verified_copy

__all__ = [
    "MigrationConfig",
    "MigrationState",
    "MigrationStatus",
    "Migrator",
    "Job",
    "files_by_rank",
]

log = logging.getLogger(__name__)


# Whole-file retries on top of the backend's own per-request retries (S3 and GCS retry each
# part and publish themselves): a few, so the two layers do not multiply.
FILE_RETRY = RetryPolicy(attempts=3, deadline=900.0, initial=1.0, maximum=30.0)


@dataclass(frozen=True)
class MigrationConfig:
    """How a process migrates: concurrency (files at once), chunking, caps and timeouts."""

    concurrency: int = 2
    chunk_size: int = 8 << 20
    bandwidth: float | None = None  # bytes per second for this process, None: no cap
    commit_timeout: float = 3600.0  # how long the coordinator waits for other ranks' marks
    poll_interval: float = 0.5
    retry: RetryPolicy = FILE_RETRY

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.chunk_size < 1:
            raise ConfigError("concurrency and chunk_size must be positive")

    @property
    def mark_polling(self) -> RetryPolicy:
        """How the coordinator polls for the other ranks' marks: from ``poll_interval``,
        doubling up to 10 s, for ``commit_timeout`` seconds."""
        return polling(self.poll_interval, self.commit_timeout, maximum=10.0)


class MigrationState(str, Enum):
    PENDING = "pending"  # queued, or committed hot and not yet cold
    UPLOADING = "uploading"
    UPLOADED = "uploaded"  # this rank's files and mark are in the cold tier
    COMMITTED = "committed"  # the cold manifest is published
    FAILED = "failed"


@dataclass(frozen=True)
class MigrationStatus:
    """Where one checkpoint's migration stands, as this process (or the tiers) know it."""

    name: str
    attempt: str
    step: int | None
    state: MigrationState
    rank: int | None
    bytes_total: int
    bytes_done: int
    created: float
    finished: float | None = None
    error: str | None = None
    failed_rank: int | None = None
    failed_file: str | None = None
    lag_seconds: float = 0.0

    @property
    def lag_bytes(self) -> int:
        return self.bytes_total - self.bytes_done


@dataclass
class Job:
    """One rank's share of one checkpoint attempt, and where it stands (the worker updates
    it as it runs); with ``manifest``, also the coordinator's cold commit."""

    name: str
    attempt: str
    step: int | None
    rank: int
    files: tuple[FileEntry, ...]
    created: float
    manifest: Manifest | None = None  # set for the coordinator's commit job
    fresh: bool = False  # the writer's own attempt, just written: nothing of it is cold yet
    state: MigrationState = MigrationState.PENDING
    bytes_done: int = 0
    finished: float | None = None
    error: str | None = None
    failed_rank: int | None = None
    failed_file: str | None = None
    listener: Callable[[int], None] | None = None
    stopped: bool = False  # set by Migrator.stop: it ends at its next chunk, or never starts
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        if self.stopped:
            raise _Stopped(f"migration of {self.name} stopped")
        with self.lock:
            self.bytes_done += n
        if self.listener is not None:
            self.listener(n)

    @property
    def done(self) -> bool:
        return self.state in (MigrationState.UPLOADED, MigrationState.COMMITTED, MigrationState.FAILED)

    def status(self, now: float) -> MigrationStatus:
        total = sum(f.size for f in self.files)
        done = total if self.state in (MigrationState.UPLOADED, MigrationState.COMMITTED) else self.bytes_done
        return MigrationStatus(
            name=self.name,
            attempt=self.attempt,
            step=self.step,
            state=self.state,
            rank=self.rank,
            bytes_total=total,
            bytes_done=done,
            created=self.created,
            finished=self.finished,
            error=self.error,
            failed_rank=self.failed_rank,
            failed_file=self.failed_file,
            lag_seconds=(self.finished or now) - self.created,
        )


class _Stopped(Exception):
    """Raised inside a job that :meth:`Migrator.stop` ended (never retried)."""


class _Failed(Exception):
    """A job's failure: the rank whose upload failed (``None``: the commit itself) and file."""

    def __init__(self, rank: int | None, file: str | None, error: BaseException | str) -> None:
        super().__init__(str(error))
        self.rank, self.file, self.error = rank, file, error


class Migrator:
    """Migrates checkpoints hot -> cold on background threads of this process.

    :meth:`submit_rank`, :meth:`submit_commit` and :meth:`submit_checkpoint` only enqueue:
    nothing they start ever raises into the caller. Jobs run in order, one checkpoint at a
    time, each uploading up to ``config.concurrency`` files at once. :meth:`status` reports
    every job, :meth:`wait` drains the queue, :meth:`stop` ends jobs (nothing of them runs
    after it: a process ending gives up on them cleanly, and the tiers keep them pending).

    **An unreachable cold tier is met once, not once per queued job.** A job that failed
    for a transient reason (retries exhausted: the cold tier down, stalled, refusing) opens
    a breaker: for ``BREAKER_SECONDS`` the jobs behind it fail at once, sending nothing,
    instead of each spending its own retries on a tier that is down (a queue of ten
    checkpoints took minutes to fail). The next job after that tries again; whatever
    failed stays pending in the tiers and is submitted again (``CheckpointManager`` does
    after each commit and at start; ``tierstore migrate`` by hand).
    """

    BREAKER_SECONDS = 30.0

    def __init__(
        self,
        hot: Tier,
        cold: Tier,
        config: MigrationConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.hot, self.cold = hot, cold
        self.config = config or MigrationConfig()
        self._clock, self._sleep = clock, sleep
        self._throttle = Throttle(self.config.bandwidth, sleep=sleep)
        self._jobs: dict[tuple[str, str, int], Job] = {}
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._unfinished = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._unreachable: tuple[float, str] | None = None  # (since, why): the breaker

    # -- control ------------------------------------------------------------------------

    def submit_rank(
        self,
        name: str,
        attempt: str,
        step: int | None,
        rank: int,
        files: Sequence[FileEntry],
        *,
        fresh: bool = False,
    ) -> None:
        """Upload ``rank``'s ``files`` of an attempt and publish its upload mark.

        ``fresh``: the caller wrote this attempt in this run (a new attempt id, so no earlier
        migrator can have uploaded, marked or failed any of it): skip the checks for that.
        """
        self._enqueue(Job(name, attempt, step, rank, tuple(files), self._clock(), fresh=fresh))

    def submit_commit(self, manifest: Manifest, rank: int, *, fresh: bool = False) -> None:
        """Coordinator: upload own files, wait for every rank's mark, publish cold manifest
        (``fresh``: as for :meth:`submit_rank`; the commit's own checks stay whole)."""
        self._enqueue(
            Job(
                manifest.name,
                manifest.attempt,
                manifest.step,
                rank,
                manifest.files_of_rank(rank),
                manifest.created,
                manifest=manifest,
                fresh=fresh,
            )
        )

    def submit_checkpoint(self, manifest: Manifest) -> None:
        """Migrate every rank's files of ``manifest`` from this hot tier and commit it, in the
        background: how a checkpoint found pending (a killed run's, or one whose migration
        failed while the cold tier was down) is finished. Checks what is already in the
        cold tier first, as ``tierstore migrate`` does."""
        by_rank = sorted(files_by_rank(manifest).items())
        for index, (rank, files) in enumerate(by_rank):
            last = index == len(by_rank) - 1
            self._enqueue(
                Job(
                    manifest.name,
                    manifest.attempt,
                    manifest.step,
                    rank,
                    files,
                    manifest.created,
                    manifest=manifest if last else None,
                )
            )

    def busy(self, name: str, attempt: str) -> bool:
        """Whether a job of this attempt is queued or running here."""
        with self._cond:
            return any(not job.done for (n, a, _), job in self._jobs.items() if (n, a) == (name, attempt))

    def stop(self, names: set[str] | None = None) -> None:
        """End the jobs of ``names`` (default: all) that have not finished: queued ones never
        start, running ones end at their next chunk; each is recorded failed ("stopped")
        and stays pending in the tiers. Returns at once."""
        with self._cond:
            for job in self._jobs.values():
                if not job.done and (names is None or job.name in names):
                    job.stopped = True

    def _enqueue(self, job: Job) -> None:
        with self._cond:
            self._jobs[(job.name, job.attempt, job.rank)] = job
            self._unfinished += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tierstore-migrator", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def status(self) -> list[MigrationStatus]:
        now = self._clock()
        with self._cond:
            jobs = list(self._jobs.values())
        return [job.status(now) for job in jobs]

    def pending(self) -> list[MigrationStatus]:
        """Jobs not yet finished (queued or uploading), those :meth:`stop` ended excepted
        (one stuck in a request's retries ends when they do, and nothing waits for it)."""
        now = self._clock()
        with self._cond:
            jobs = [job for job in self._jobs.values() if not job.done and not job.stopped]
        return [job.status(now) for job in jobs]

    def failures(self) -> list[MigrationStatus]:
        return [s for s in self.status() if s.state is MigrationState.FAILED]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished; ``False`` if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._unfinished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        drained = self.wait(timeout)
        self._queue.put(None)
        return drained

    # -- work -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self.run(job)
            finally:
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()

    def migrate_checkpoint(
        self, manifest: Manifest, progress: Callable[[str, int, int], None] | None = None
    ) -> MigrationStatus:
        """Migrate every rank's files of ``manifest`` and commit it, here and now (this
        thread): how ``tierstore migrate`` finishes a checkpoint a crash left pending.
        ``progress(name, bytes_done, bytes_total)``; failure is in the status, not raised."""
        total = manifest.total_size
        jobs = [
            Job(manifest.name, manifest.attempt, manifest.step, rank, files, manifest.created)
            for rank, files in sorted(files_by_rank(manifest).items())
        ]
        jobs[-1].manifest = manifest  # the last rank's job also commits
        advance = counting(manifest.name, total, progress)
        for job in jobs:
            job.listener = advance
            self.run(job)
            if job.state is MigrationState.FAILED:
                return replace(
                    job.status(self._clock()), rank=None, bytes_total=total, bytes_done=advance.done
                )
        return replace(jobs[-1].status(self._clock()), rank=None, bytes_total=total, bytes_done=total)

    def run(self, job: Job) -> None:
        """Run one job to its end state, recording (never raising) failure."""
        job.state = MigrationState.UPLOADING
        try:
            if job.stopped:
                raise _Failed(job.rank, None, "stopped before it started")
            self._check_breaker()
            self._upload_rank(job)
            if job.manifest is None:
                job.state = MigrationState.UPLOADED
            else:
                self._commit(job.manifest, job)
                job.state = MigrationState.COMMITTED
            self._unreachable = None
            log.info("migrated %s rank %d to %s (%s)", job.name, job.rank, self.cold.label, job.state.value)
        except _Failed as failure:
            self._record_failure(job, failure)
        except Exception as err:  # unexpected: still never into training
            self._record_failure(job, _Failed(job.rank, None, err))
        finally:
            job.finished = self._clock()

    def _check_breaker(self) -> None:
        unreachable = self._unreachable
        if unreachable is None:
            return
        since, why = unreachable
        if self._clock() - since < self.BREAKER_SECONDS:
            raise _Failed(
                None,
                None,
                TransientStorageError(
                    f"not attempted: the cold tier was unreachable {self._clock() - since:.0f}s ago "
                    f"({why}); the next commit (or `tierstore migrate`) tries again",
                    tier=self.cold.label,
                ),
            )
        self._unreachable = None  # long enough: this job tries again

    def _record_failure(self, job: Job, failure: _Failed) -> None:
        job.state = MigrationState.FAILED
        if isinstance(failure.error, _Stopped) or (job.stopped and failure.rank is not None):
            failure = _Failed(
                None, None, "stopped: the process gave up on it (close() ran out of time, or it is exiting)"
            )
        job.error = (
            f"{type(failure.error).__name__}: {failure.error}"
            if isinstance(failure.error, BaseException)
            else str(failure.error)
        )
        job.failed_rank, job.failed_file = failure.rank, failure.file
        if job.stopped:
            log.info("migration of %s to %s stopped; it stays pending", job.name, self.cold.label)
            return
        log.error(
            "migration of checkpoint %s to %s failed: rank %s, file %s: %s",
            job.name,
            self.cold.label,
            failure.rank,
            failure.file,
            job.error,
        )
        transient = isinstance(failure.error, TransientStorageError)
        if transient and self._unreachable is None:
            self._unreachable = (self._clock(), job.error)
        if failure.rank == job.rank:
            # Tell the coordinator not to wait for us; on a thread of its own, so a cold tier
            # out of reach spends the mark's retries there, not the queue's time.
            threading.Thread(
                target=marks.publish_failure,
                daemon=True,
                name="tierstore-failure-mark",
                args=(self.cold, job.name, job.attempt, job.rank, failure.file, job.error),
            ).start()

    def _upload_rank(self, job: Job) -> None:
        if not job.fresh and marks.already_uploaded(self.cold, job.name, job.attempt, job.rank, job.files):
            job.add_bytes(sum(f.size for f in job.files))
            return  # already done by an earlier migrator, and the very objects still there
        versions: dict[str, str | None] = {}  # what each verified upload (or copy) stored
        errors = _in_parallel(
            [functools.partial(self._upload_file, job, entry, versions) for entry in job.files],
            self.config.concurrency,
        )
        for error in errors:
            if error is not None:
                raise error if isinstance(error, _Failed) else _Failed(job.rank, None, error)
        faults.point("migrator.before_mark_publish")

        def publish() -> None:
            marks.publish_upload_mark(self.cold, job.name, job.attempt, job.rank, job.files, versions)

        try:
            self.config.retry.call(
                publish, what=f"upload mark of rank {job.rank} ({job.name})", sleep=self._sleep
            )
        except Exception as err:
            raise _Failed(job.rank, None, err) from err
        if not job.fresh:  # a fresh attempt has no failure mark to resolve
            marks.clear_failure(self.cold, job.name, job.attempt, job.rank)

    def _upload_file(self, job: Job, entry: FileEntry, versions: dict[str, str | None]) -> None:
        try:
            if not job.fresh:
                there = verified_copy(
                    self.cold, job.name, job.attempt, entry, chunk_size=self.config.chunk_size
                )
                if there is not None:
                    versions[entry.path] = there.version
                    job.add_bytes(entry.size)
                    return
            sent = [0]

            def attempt() -> None:
                job.add_bytes(-sent[0])  # a retry starts the file over
                sent[0] = 0

                def progress(n: int) -> None:
                    sent[0] += n
                    job.add_bytes(n)

                # Never delete first: the object may be another migrator's verified copy.
                # The write replaces the key atomically with the same verified bytes, and
                # an aborted write leaves whatever was there (the backend contract).
                versions[entry.path] = copy_file(
                    self.hot,
                    self.cold,
                    job.name,
                    job.attempt,
                    entry,
                    chunk_size=self.config.chunk_size,
                    throttle=self._throttle,
                    progress=progress,
                )

            self.config.retry.call(attempt, what=f"upload of {entry.path} ({job.name})", sleep=self._sleep)
            faults.point("migrator.after_file_upload")
        except Exception as err:
            raise _Failed(job.rank, entry.path, err) from err

    def _commit(self, manifest: Manifest, job: Job | None = None) -> None:
        by_rank = files_by_rank(manifest)
        listing = self._await_marks(manifest, by_rank, job)
        if listing is None:  # another migrator committed it meanwhile
            cold_id = marks.store_id(self.cold, create=True)
            assert cold_id is not None
            marks.mark_migrated(self.hot, manifest, cold_id)
            return
        cold_id = marks.store_id(self.cold, create=True)
        assert cold_id is not None  # created if it was missing
        faults.point("migrator.before_cold_publish")
        # The marks say every rank uploaded; the manifest may only vouch for bytes that are
        # verified and in place now (another actor may have removed or replaced an object
        # since): docs/design.md invariant 10.
        self._check_in_place(manifest, by_rank, listing)
        faults.point("migrator.after_cold_check")
        self._publish(manifest)
        faults.point("migrator.after_cold_publish")
        marks.mark_migrated(self.hot, manifest, cold_id)
        # The marks did their job; a crash before this leaves them to GC.
        try:
            marks.clear_upload_marks(self.cold, manifest.name, manifest.attempt, listing.keys)
        except TierstoreError as err:
            log.info("left upload marks of %s for GC: %s", manifest.name, err)

    def _check_in_place(
        self, manifest: Manifest, by_rank: dict[int, tuple[FileEntry, ...]], listing: marks.MarkListing
    ) -> None:
        """Raise unless every file of ``manifest`` is in the cold tier with its verified bytes.

        One listing per data prefix shows presence and size, and CRC32C where the store
        lists it (GCS). A rank's files are proved by that CRC32C, or by being listed at the
        very versions its mark says it verified; a rank whose files are not (one replaced
        since the upload, by anyone, or a store without versions) has each file verified
        again here, by the store's CRC32C or by reading it back.
        """
        name, attempt = manifest.name, manifest.attempt
        absent, listed = marks.check_in_place(
            self.cold, name, attempt, (f for files in by_rank.values() for f in files)
        )
        if absent:
            raise self._not_as_uploaded(manifest, absent, "missing, or its size differs")
        unproved = [
            f
            for rank, files in by_rank.items()
            if not self._proved(listing, rank, files, listed)
            for f in files
        ]
        if not unproved:
            return
        log.info(
            "verifying %d file(s) of %s again before the cold commit: not listed as the "
            "objects their ranks verified",
            len(unproved),
            name,
        )
        bad: list[FileEntry] = []
        checks = [functools.partial(self._recheck, manifest, entry, bad) for entry in unproved]
        for error in _in_parallel(checks, self.config.concurrency):
            if error is not None:
                raise _Failed(None, None, error)
        if bad:
            raise self._not_as_uploaded(
                manifest,
                sorted(bad, key=lambda f: (f.rank, f.path)),
                "its bytes differ from the ones uploaded",
            )

    def _proved(
        self,
        listing: marks.MarkListing,
        rank: int,
        files: tuple[FileEntry, ...],
        listed: dict[str, ObjectInfo],
    ) -> bool:
        if all(listed[f.path].crc32c is not None for f in files):
            return True  # the store's own CRC32C, compared by check_in_place
        now = {f.path: listed[f.path].version for f in files}
        return listing.vouches(rank, marks.files_digest(files), marks.versions_digest(files, now))

    def _recheck(self, manifest: Manifest, entry: FileEntry, bad: list[FileEntry]) -> None:
        if (
            verified_copy(
                self.cold, manifest.name, manifest.attempt, entry, chunk_size=self.config.chunk_size
            )
            is None
        ):
            bad.append(entry)

    def _not_as_uploaded(self, manifest: Manifest, files: Sequence[FileEntry], why: str) -> _Failed:
        entry = files[0]
        return _Failed(
            entry.rank,
            entry.path,
            ChecksumMismatch(
                f"not in the cold tier as uploaded ({why}; {len(files)} file(s) in all) at the "
                "cold commit; `tierstore migrate` uploads it again",
                checkpoint=manifest.name,
                file=entry.path,
                tier=self.cold.label,
            ),
        )

    def _publish(self, manifest: Manifest) -> None:
        def publish() -> None:
            try:
                self.cold.publish_manifest(manifest)
            except CheckpointExists:
                existing = self.cold.find_manifest(manifest.name)
                if existing is None or existing.attempt != manifest.attempt:
                    other = existing.attempt if existing is not None else "unknown"
                    raise CheckpointExists(
                        f"the cold tier holds another committed attempt ({other}) of this "
                        "checkpoint; it is never overwritten, so this attempt stays hot only",
                        checkpoint=manifest.name,
                        tier=self.cold.label,
                    ) from None
                # ours already: an earlier run (or an ambiguous publish) committed it

        try:
            self.config.retry.call(publish, what=f"cold commit of {manifest.name}", sleep=self._sleep)
        except Exception as err:
            raise _Failed(None, None, err) from err

    def _await_marks(
        self, manifest: Manifest, by_rank: dict[int, tuple[FileEntry, ...]], job: Job | None = None
    ) -> marks.MarkListing | None:
        """Wait until one listing shows every rank marked for its files of ``manifest`` (that
        listing), or until another migrator has committed this very attempt (``None``: it also
        removed the marks, so waiting on would only run into the timeout)."""
        expected = {rank: marks.files_digest(files) for rank, files in by_rank.items()}
        seen: set[int] = set()  # remembered across rounds: each round only lists
        last: list[marks.MarkListing] = []

        def missing() -> list[int] | None:
            """Ranks still to mark; ``None`` once another migrator committed the attempt."""
            if job is not None and job.stopped:  # stop() ends the wait too, not only uploads
                raise _Failed(None, None, _Stopped(f"migration of {manifest.name} stopped"))
            listing = marks.list_marks(self.cold, manifest.name, manifest.attempt)
            last[:] = [listing]
            seen.update(
                rank for rank, digest in expected.items() if rank not in seen and listing.marked(rank, digest)
            )
            left = [rank for rank in expected if rank not in seen]
            if not left:
                return left
            if self._committed_by_another(manifest):
                log.info("%s was committed in %s by another migrator", manifest.name, self.cold.label)
                return None
            for rank in left:
                if rank in listing.failed:  # read only the failure marks the listing shows
                    failure = marks.read_failure(self.cold, manifest.name, manifest.attempt, rank)
                    if failure is not None:
                        raise _Failed(rank, failure.get("file"), failure.get("error", "failed"))
            return left

        left = self.config.mark_polling.poll(missing, until=lambda left: not left, sleep=self._sleep)
        if left:
            raise _Failed(
                left[0], None, f"no upload mark from ranks {left} after {self.config.commit_timeout:.0f}s"
            )
        return None if left is None else last[0]

    def _committed_by_another(self, manifest: Manifest) -> bool:
        try:
            return self.cold.find_manifest(manifest.name) == manifest
        except IntegrityError:
            return False  # an invalid cold manifest commits nothing; the publish will say so


def files_by_rank(manifest: Manifest) -> dict[int, tuple[FileEntry, ...]]:
    """Each rank's files of ``manifest``, in one pass over them (not one pass per rank)."""
    by_rank: dict[int, list[FileEntry]] = {}
    for entry in manifest.files:
        by_rank.setdefault(entry.rank, []).append(entry)
    return {rank: tuple(files) for rank, files in by_rank.items()}


def _in_parallel(calls: Sequence[Callable[[], None]], width: int) -> list[BaseException | None]:
    """Run ``calls`` on up to ``width`` *daemon* threads; each one's exception, or ``None``.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so an upload
    stuck on a stalled cold tier would hold the training process's exit forever, whatever
    ``TIERSTORE_EXIT_WAIT`` says. Daemon threads leave that bound to :mod:`tierstore.tiers.workers`.
    """
    errors: list[BaseException | None] = [None] * len(calls)
    todo = iter(range(len(calls)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                index = next(todo, None)
            if index is None:
                return
            try:
                calls[index]()
            except BaseException as err:  # reported to the job, never lost
                errors[index] = err

    threads = [
        threading.Thread(target=work, name="tierstore-upload", daemon=True)
        for _ in range(min(width, len(calls)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
