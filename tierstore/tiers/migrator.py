"""Background, resumable, idempotent migration from the hot tier to the cold tier.

Protocol for one checkpoint attempt (DESIGN.md invariants 2, 6, 7):

1. **Each rank** uploads the files it wrote, in the background of whatever process finished
   its part of the save. Every upload is verified: the source bytes against the manifest's
   size and CRC32C as they stream, the stored object by the cold backend. The rank then
   publishes its *upload mark* ``uploads/<name>/<attempt>/rank-<r>.json`` naming them.
2. **The coordinator**, once the hot manifest is committed, uploads its own files (DCP's
   ``.metadata`` among them), waits for the marks of every rank that owns files, checks
   them against the manifest and publishes the cold manifest, exclusively: the cold commit.

The tiers are the only durable state. A checkpoint with a hot manifest and no cold manifest
is *pending*; :func:`tierstore.tiers.status.migrate_pending` (``tierstore migrate``) finishes it
from any process, later, skipping ranks whose mark exists and files already stored intact. Failures are
retried (:mod:`tierstore.retry`), then recorded (status, log, and a failure mark
``rank-<r>.failed.json`` that stops the coordinator waiting) and never raised into training.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from tierstore.commit import layout
from tierstore.commit.manifest import FileEntry, Manifest
from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    ConfigError,
    IntegrityError,
    ObjectNotFound,
    TierstoreError,
)
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier
from tierstore.tiers.transfer import Throttle, copy_file, has_verified_copy

__all__ = [
    "MigrationConfig",
    "MigrationState",
    "MigrationStatus",
    "Migrator",
    "migrator_for",
    "active_migrators",
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
class _Job:
    name: str
    attempt: str
    step: int | None
    rank: int
    files: tuple[FileEntry, ...]
    created: float
    manifest: Manifest | None = None  # set for the coordinator's commit job
    state: MigrationState = MigrationState.PENDING
    bytes_done: int = 0
    finished: float | None = None
    error: str | None = None
    failed_rank: int | None = None
    failed_file: str | None = None
    listener: Callable[[int], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n
        if self.listener is not None:
            self.listener(n)


class _Failed(Exception):
    """A job's failure: the rank whose upload failed (``None``: the commit itself) and file."""

    def __init__(self, rank: int | None, file: str | None, error: BaseException | str) -> None:
        super().__init__(str(error))
        self.rank, self.file, self.error = rank, file, error


class Migrator:
    """Migrates checkpoints hot -> cold on background threads of this process.

    :meth:`submit_rank` and :meth:`submit_commit` only enqueue: nothing they start ever
    raises into the caller. Jobs run in order, one checkpoint at a time, each uploading up to
    ``config.concurrency`` files at once. :meth:`status` reports every job, :meth:`wait`
    drains the queue.
    """

    def __init__(self, hot: Tier, cold: Tier, config: MigrationConfig | None = None, *,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.hot, self.cold = hot, cold
        self.config = config or MigrationConfig()
        self._clock, self._sleep = clock, sleep
        self._throttle = Throttle(self.config.bandwidth, sleep=sleep)
        self._jobs: dict[tuple[str, str, int], _Job] = {}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._unfinished = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- control ------------------------------------------------------------------------

    def submit_rank(self, name: str, attempt: str, step: int | None, rank: int,
                    files: Sequence[FileEntry]) -> None:
        """Upload ``rank``'s ``files`` of an attempt and publish its upload mark."""
        self._enqueue(_Job(name, attempt, step, rank, tuple(files), self._clock()))

    def submit_commit(self, manifest: Manifest, rank: int) -> None:
        """Coordinator: upload own files, wait for every rank's mark, publish cold manifest."""
        self._enqueue(_Job(manifest.name, manifest.attempt, manifest.step, rank,
                           manifest.files_of_rank(rank), manifest.created, manifest=manifest))

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            self._jobs[(job.name, job.attempt, job.rank)] = job
            self._unfinished += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tierstore-migrator",
                                                 daemon=True)
                self._thread.start()
        self._queue.put(job)

    def status(self) -> list[MigrationStatus]:
        now = self._clock()
        with self._cond:
            jobs = list(self._jobs.values())
        return [_status_of(job, now) for job in jobs]

    def pending(self) -> list[MigrationStatus]:
        """Jobs not yet finished (queued or uploading)."""
        done = (MigrationState.UPLOADED, MigrationState.COMMITTED, MigrationState.FAILED)
        return [s for s in self.status() if s.state not in done]

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

    def run(self, job: _Job) -> None:
        """Run one job to its end state, recording (never raising) failure."""
        job.state = MigrationState.UPLOADING
        try:
            self._upload_rank(job)
            if job.manifest is None:
                job.state = MigrationState.UPLOADED
            else:
                self._commit(job.manifest)
                job.state = MigrationState.COMMITTED
            log.info("migrated %s rank %d to %s (%s)", job.name, job.rank, self.cold.label, job.state.value)
        except _Failed as failure:
            self._record_failure(job, failure)
        except Exception as err:  # unexpected: still never into training
            self._record_failure(job, _Failed(job.rank, None, err))
        finally:
            job.finished = self._clock()

    def _record_failure(self, job: _Job, failure: _Failed) -> None:
        job.state = MigrationState.FAILED
        job.error = f"{type(failure.error).__name__}: {failure.error}" \
            if isinstance(failure.error, BaseException) else str(failure.error)
        job.failed_rank, job.failed_file = failure.rank, failure.file
        log.error("migration of checkpoint %s to %s failed: rank %s, file %s: %s",
                  job.name, self.cold.label, failure.rank, failure.file, job.error)
        if failure.rank == job.rank:  # tell the coordinator not to wait for us
            marks.publish_failure(self.cold, job.name, job.attempt, job.rank, failure.file,
                                  job.error)

    def _upload_rank(self, job: _Job) -> None:
        try:
            marked = marks.read_upload_mark(self.cold, job.name, job.attempt, job.rank)
        except IntegrityError as err:
            log.warning("re-uploading rank %d of %s: %s", job.rank, job.name, err)
            marked = None
        files = tuple(sorted(job.files, key=lambda f: (f.rank, f.path)))
        if marked == files and all(self._in_place(e, job.name, job.attempt) for e in files):
            job.add_bytes(sum(f.size for f in job.files))
            return  # already done by an earlier migrator, and still there
        errors = _in_parallel([functools.partial(self._upload_file, job, entry) for entry in job.files],
                              self.config.concurrency)
        for error in errors:
            if error is not None:
                raise error if isinstance(error, _Failed) else _Failed(job.rank, None, error)
        faults.point("migrator.before_mark_publish")

        def publish() -> None:
            marks.publish_upload_mark(self.cold, job.name, job.attempt, job.rank, files)

        try:
            self.config.retry.call(publish, what=f"upload mark of rank {job.rank} ({job.name})",
                                   sleep=self._sleep)
        except Exception as err:
            raise _Failed(job.rank, None, err) from err
        marks.clear_failure(self.cold, job.name, job.attempt, job.rank)  # resolved, if any

    def _upload_file(self, job: _Job, entry: FileEntry) -> None:
        try:
            if has_verified_copy(self.cold, job.name, job.attempt, entry,
                                 chunk_size=self.config.chunk_size):
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
                copy_file(self.hot, self.cold, job.name, job.attempt, entry,
                          chunk_size=self.config.chunk_size, throttle=self._throttle,
                          progress=progress)

            self.config.retry.call(attempt, what=f"upload of {entry.path} ({job.name})",
                                   sleep=self._sleep)
            faults.point("migrator.after_file_upload")
        except Exception as err:
            raise _Failed(job.rank, entry.path, err) from err

    def _in_place(self, entry: FileEntry, name: str, attempt: str) -> bool:
        """Is ``entry`` stored in cold with its size (and CRC32C, where the store keeps one)?"""
        try:
            info = self.cold.backend.stat(self.cold.file_key(name, attempt, entry.path))
        except ObjectNotFound:
            return False
        return info.size == entry.size and info.crc32c in (None, entry.crc32c)

    def _commit(self, manifest: Manifest) -> None:
        if self._await_marks(manifest):  # another migrator committed it meanwhile
            cold_id = marks.store_id(self.cold, create=True)
            assert cold_id is not None
            marks.mark_migrated(self.hot, manifest, cold_id)
            return
        cold_id = marks.store_id(self.cold, create=True)
        assert cold_id is not None  # created if it was missing
        faults.point("migrator.before_cold_publish")
        # The marks say every rank uploaded; the manifest may only vouch for what is there
        # now (another actor may have removed or damaged an object since).
        for entry in manifest.files:
            if not self._in_place(entry, manifest.name, manifest.attempt):
                raise _Failed(entry.rank, entry.path, ChecksumMismatch(
                    "not in the cold tier as uploaded (missing, or its size or CRC32C "
                    "differ) at the cold commit; `tierstore migrate` uploads it again",
                    checkpoint=manifest.name, file=entry.path, tier=self.cold.label))

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
                        checkpoint=manifest.name, tier=self.cold.label) from None
                # ours already: an earlier run (or an ambiguous publish) committed it

        try:
            self.config.retry.call(publish, what=f"cold commit of {manifest.name}", sleep=self._sleep)
        except Exception as err:
            raise _Failed(None, None, err) from err
        faults.point("migrator.after_cold_publish")
        marks.mark_migrated(self.hot, manifest, cold_id)
        # The marks did their job; a crash before this leaves them to GC.
        try:
            for info in list(self.cold.backend.list(layout.upload_prefix(manifest.name, manifest.attempt))):
                self.cold.backend.delete(info.key)
        except TierstoreError as err:
            log.info("left upload marks of %s for GC: %s", manifest.name, err)

    def _await_marks(self, manifest: Manifest) -> bool:
        """Wait until every rank's mark is there (``False``), or until another migrator has
        committed this very attempt (``True``: it also removed the marks, so waiting on would
        only run into the timeout)."""
        ranks = sorted({f.rank for f in manifest.files})
        deadline = time.monotonic() + self.config.commit_timeout
        delay = self.config.poll_interval
        done: set[int] = set()  # a mark stays until the commit: read each one only until seen
        while True:
            missing = [r for r in ranks if r not in done and not self._rank_uploaded(manifest, r)]
            done.update(r for r in ranks if r not in missing)
            if not missing:
                return False
            if self._committed_by_another(manifest):
                log.info("%s was committed in %s by another migrator", manifest.name, self.cold.label)
                return True
            for rank in missing:
                failure = marks.read_failure(self.cold, manifest.name, manifest.attempt, rank)
                if failure is not None:
                    raise _Failed(rank, failure.get("file"), failure.get("error", "failed"))
            if time.monotonic() > deadline:
                raise _Failed(missing[0], None, f"no upload mark from ranks {missing} after "
                                                f"{self.config.commit_timeout:.0f}s")
            self._sleep(delay)
            delay = min(delay * 2, 10.0)

    def _committed_by_another(self, manifest: Manifest) -> bool:
        try:
            return self.cold.find_manifest(manifest.name) == manifest
        except IntegrityError:
            return False  # an invalid cold manifest commits nothing; the publish will say so

    def _rank_uploaded(self, manifest: Manifest, rank: int) -> bool:
        """Has ``rank`` uploaded its files? Its mark says so; a damaged or wrong mark is
        repaired when every file it should vouch for is in place, and fails the commit
        (for ``tierstore migrate`` to upload again) when not."""
        expected = manifest.files_of_rank(rank)
        try:
            marked = marks.read_upload_mark(self.cold, manifest.name, manifest.attempt, rank)
        except IntegrityError as err:
            problem = str(err)
        else:
            if marked is None:
                return False
            if marked == expected:
                return True
            problem = "it lists other files than the manifest"
        if not all(self._in_place(e, manifest.name, manifest.attempt) for e in expected):
            raise _Failed(rank, None, IntegrityError(
                f"upload mark is wrong ({problem}) and the rank's files are not all in the "
                "cold tier; `tierstore migrate` uploads them again",
                checkpoint=manifest.name, rank=rank, tier=self.cold.label))
        log.warning("repairing the upload mark of rank %d of %s in %s: %s", rank,
                    manifest.name, self.cold.label, problem)
        marks.publish_upload_mark(self.cold, manifest.name, manifest.attempt, rank, expected)
        return True


def _in_parallel(calls: Sequence[Callable[[], None]], width: int) -> list[BaseException | None]:
    """Run ``calls`` on up to ``width`` *daemon* threads; each one's exception, or ``None``.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so an upload
    stuck on a stalled cold tier would hold the training process's exit forever, whatever
    ``TIERSTORE_EXIT_WAIT`` says. Daemon threads leave that bound to :func:`_drain_at_exit`.
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

    threads = [threading.Thread(target=work, name="tierstore-upload", daemon=True)
               for _ in range(min(width, len(calls)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _status_of(job: _Job, now: float) -> MigrationStatus:
    total = sum(f.size for f in job.files)
    done = total if job.state in (MigrationState.UPLOADED, MigrationState.COMMITTED) else job.bytes_done
    return MigrationStatus(
        name=job.name, attempt=job.attempt, step=job.step, state=job.state, rank=job.rank,
        bytes_total=total, bytes_done=done, created=job.created, finished=job.finished,
        error=job.error, failed_rank=job.failed_rank, failed_file=job.failed_file,
        lag_seconds=(job.finished or now) - job.created,
    )


# -- one migrator per (hot, cold) in a process ---------------------------------------------

_MIGRATORS: dict[tuple[str, str, str], Migrator] = {}
_MIGRATORS_LOCK = threading.Lock()


def _tier_id(tier: Tier) -> str:
    return json.dumps([tier.url, tier.options], sort_keys=True, default=repr)


def migrator_for(hot: Tier, cold: Tier, config: MigrationConfig | None = None) -> Migrator:
    """This process's migrator for ``hot`` -> ``cold``, created on first use.

    Writers are built per save; the migrator outlives them, so it is kept per process.
    The first caller's ``config`` wins.
    """
    key = (_tier_id(hot), _tier_id(cold), "")
    with _MIGRATORS_LOCK:
        migrator = _MIGRATORS.get(key)
        if migrator is None:
            migrator = _MIGRATORS[key] = Migrator(hot, cold, config)
        return migrator


def active_migrators() -> list[Migrator]:
    with _MIGRATORS_LOCK:
        return list(_MIGRATORS.values())


def _forget_after_fork() -> None:
    # Threads do not survive fork: a child starts with no migrators (and no stale locks).
    global _MIGRATORS_LOCK
    _MIGRATORS.clear()
    _MIGRATORS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)

EXIT_WAIT_ENV = "TIERSTORE_EXIT_WAIT"


def _drain_at_exit() -> None:
    """Give uploads a bounded chance to finish when the process exits (default 600 s)."""
    migrators = active_migrators()
    if not any(m.pending() for m in migrators):
        return
    timeout = float(os.environ.get(EXIT_WAIT_ENV, "600"))
    log.warning("waiting up to %.0fs for checkpoint migrations before exit", timeout)
    deadline = time.monotonic() + timeout
    for migrator in migrators:
        if not migrator.wait(max(0.0, deadline - time.monotonic())):
            log.error("exiting with migrations pending; `tierstore migrate` will finish them")


atexit.register(_drain_at_exit)
