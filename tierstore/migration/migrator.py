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
is *pending*; :func:`tierstore.migration.status.migrate_pending` (``tierstore migrate``) finishes it
from any process, later, skipping ranks whose mark exists and files already stored intact. Failures are
retried (:mod:`tierstore.retry`), then recorded (status, log, and a failure mark
``rank-<r>.failed.json`` that stops the coordinator waiting) and never raised into training.

This module is the worker; its cold commit (step 2) is :mod:`tierstore.migration.cold_commit`,
what it works on :mod:`tierstore.migration.jobs`, the jobs it holds and the attempts it
delivered :mod:`tierstore.migration.job_table`, its breaker :mod:`tierstore.migration.breaker`.
What the marks are and when one counts is :mod:`tierstore.tiers.marks`; which migrator a
process uses, and draining it at exit, :mod:`tierstore.migration.workers`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from tierstore.errors import (
    CheckpointExists,
    ConfigError,
    IntegrityError,
    TierstoreError,
    TransientStorageError,
    UnsafeType,
)
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.breaker import Breaker
from tierstore.migration.cold_commit import ColdCommit
from tierstore.migration.job_table import JobTable
from tierstore.migration.jobs import (
    Job,
    JobFailed,
    JobStopped,
    MigrationOptions,
    MigrationState,
    MigrationStatus,
    files_by_rank,
    in_parallel,
)
from tierstore.migration.transfer import Throttle, copy_file, verified_copy
from tierstore.progress import counting
from tierstore.storage import faults
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier

__all__ = [
    "MigrationOptions",
    "MigrationState",
    "MigrationStatus",
    "Migrator",
    "Job",
    "files_by_rank",
]

log = logging.getLogger(__name__)


class Migrator(ColdCommit):
    """Migrates checkpoints hot -> cold on background threads of this process.

    :meth:`submit_rank`, :meth:`submit_commit` and :meth:`submit_checkpoint` only enqueue:
    nothing they start ever raises into the caller. Uploads run in order, one checkpoint at
    a time, each up to ``config.concurrency`` files at once; a commit that must wait for
    other ranks' marks waits on a thread of its own, so one stuck commit never holds the
    queue. :meth:`status` reports every job, :meth:`wait` drains the queue, :meth:`stop`
    ends jobs (nothing of them runs after it: a process ending gives up on them cleanly,
    and the tiers keep them pending).

    **One job per checkpoint** (docs/design.md invariant 25). A job is never queued for an
    attempt this migrator has queued, is running, or has delivered; a job that is not the
    writer's own (a resumed migration) first asks the hot tier whether the attempt was
    delivered already (its migrated mark naming this cold tier) and ends at once if so; a
    commit whose attempt's marks are deleted while it waits (a prune of the cold tier, or
    another migrator's commit) ends at once instead of polling until ``commit_timeout``.

    **An unreachable cold tier is met once, and probed** (invariant 26). A job that failed
    for a transient reason (retries exhausted: the cold tier down, stalled, refusing)
    opens a breaker: the jobs behind it fail at once, sending nothing, instead of each
    spending its own retries on a tier that is down. The breaker lets a probe through
    (one listing, bounded by ``PROBE_WAIT``) ``FIRST_PROBE`` seconds after it opened, then
    at doubling intervals up to ``BREAKER_SECONDS``; the job that probes runs if the tier
    answers. Whatever failed stays pending in the tiers; :meth:`retry_failed` queues it
    again (``CheckpointManager.close()``, ``wait(timeout=)`` and the preemption push do,
    until their deadline; the manager after each commit; ``tierstore migrate`` by hand).
    """

    FIRST_PROBE = 1.0  # seconds from a transient failure to the breaker's first probe
    BREAKER_SECONDS = 30.0  # the longest pause between two probes of a tier that is down

    def __init__(
        self,
        hot: Tier,
        cold: Tier,
        config: MigrationOptions | None = None,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.hot, self.cold = hot, cold
        self.config = config or MigrationOptions()
        self._clock, self._sleep = clock, sleep
        self._throttle = Throttle(self.config.bandwidth, sleep=sleep)
        self._jobs = JobTable()
        self._breaker = Breaker(cold, clock=clock, first_probe=self.FIRST_PROBE, longest=self.BREAKER_SECONDS)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()

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
    ) -> bool:
        """Upload ``rank``'s ``files`` of an attempt and publish its upload mark; ``False``
        if a job of that rank and attempt is queued, running or done here already.

        ``fresh``: the caller wrote this attempt in this run (a new attempt id, so no earlier
        migrator can have uploaded, marked or failed any of it): skip the checks for that.
        """
        return self._enqueue(Job(name, attempt, step, rank, tuple(files), self._clock(), fresh=fresh))

    def submit_commit(self, manifest: Manifest, rank: int, *, fresh: bool = False) -> bool:
        """Coordinator: upload own files, wait for every rank's mark, publish cold manifest
        (``fresh``: as for :meth:`submit_rank`; the commit's own checks stay whole).
        ``False`` if this rank's job of it is queued or running, or the attempt was delivered
        here already."""
        if self.delivered(manifest.name, manifest.attempt):
            return False  # other ranks' jobs of it may run here (ranks sharing a process)
        return self._enqueue(Job.of(manifest, rank, commits=True, fresh=fresh))

    def submit_checkpoint(self, manifest: Manifest, *, since: float | None = None) -> bool:
        """Migrate every rank's files of ``manifest`` from this hot tier and commit it, in the
        background: how a checkpoint found pending (a killed run's, or one whose migration
        failed while the cold tier was down) is finished. Checks what is already in the
        cold tier first, as ``tierstore migrate`` does. ``False`` (nothing queued) if this
        attempt is queued or running here, or was delivered here (``since``: after that
        ``time.monotonic()`` value, when the look that found it pending began; one delivered
        before that look is pending again: the cold tier lost it, wiped or re-created)."""
        if self.handles(manifest.name, manifest.attempt, since=since):
            return False
        self._jobs.forget_delivered(manifest.name, manifest.attempt)  # delivered again
        by_rank = sorted(files_by_rank(manifest).items())
        queued = False
        for index, (rank, files) in enumerate(by_rank):
            last = index == len(by_rank) - 1
            queued |= self._enqueue(Job.of(manifest, rank, files, commits=last))
        return queued

    def handles(self, name: str, attempt: str, *, since: float | None = None) -> bool:
        """Whether a job of this attempt is queued or running here, or this migrator
        delivered it (``since``: at or after that ``time.monotonic()`` value): no other job
        of it is wanted (invariant 25)."""
        return self._jobs.handles(name, attempt, since=since)

    busy = handles  # the name it had before it also counted delivered attempts

    def retry_failed(self, names: set[str] | None = None) -> list[str]:
        """Queue again each job of ``names`` (default: all) that failed for a reason another
        try may cure (the cold tier down or refusing, a rank's mark that never came), not
        for one that stays (a conflicting attempt in cold, damaged bytes, a bad option), nor
        one :meth:`stop` ended. A job queued again checks what is in the cold tier first, so
        nothing done is done twice. Returns the names queued."""
        failed = self._jobs.to_retry(names)
        failed.sort(key=lambda job: job.manifest is not None)  # a checkpoint's commit after its uploads
        queued = [job.name for job in failed if self._enqueue(job.again(self._clock()))]
        return sorted(set(queued))

    def to_retry(self, names: set[str] | None = None) -> set[str]:
        """The names of ``names`` (default: all) with a failed job :meth:`retry_failed` would
        queue again."""
        return {job.name for job in self._jobs.to_retry(names)}

    def delivered(self, name: str, attempt: str) -> bool:
        """Whether this migrator committed this attempt, or found it committed already."""
        return self._jobs.delivered(name, attempt)

    def cold_answered(self) -> None:
        """The cold tier answered (a probe of the caller's, or a job that succeeded): close
        the breaker, so the next job is attempted."""
        self._breaker.close()

    def stop(self, names: set[str] | None = None) -> None:
        """End the jobs of ``names`` (default: all) that have not finished: queued ones never
        start, running ones end at their next chunk; each is recorded failed ("stopped")
        and stays pending in the tiers. Returns at once."""
        self._jobs.stop(names)

    def _enqueue(self, job: Job) -> bool:
        if not self._jobs.add(job):
            return False
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tierstore-migrator", daemon=True)
                self._thread.start()
        self._queue.put(job)
        return True

    def status(self) -> list[MigrationStatus]:
        return self._jobs.status(self._clock())

    def pending(self) -> list[MigrationStatus]:
        """Jobs not yet finished (queued or uploading), those :meth:`stop` ended excepted
        (one stuck in a request's retries ends when they do, and nothing waits for it)."""
        return self._jobs.status(self._clock(), unfinished=True)

    def failures(self) -> list[MigrationStatus]:
        return [s for s in self.status() if s.state is MigrationState.FAILED]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished; ``False`` if ``timeout`` ran out first."""
        return self._jobs.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        drained = self.wait(timeout)
        self._queue.put(None)
        return drained

    # -- work -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            commits = False
            try:
                commits = self._upload(job)
            finally:
                if commits:  # waits for other ranks' marks: never on the queue's thread
                    threading.Thread(
                        target=self._commit_then_end, args=(job,), name="tierstore-commit", daemon=True
                    ).start()
                else:
                    self._jobs.ended()

    def _commit_then_end(self, job: Job) -> None:
        try:
            self._finish(job)
        finally:
            self._jobs.ended()

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
        advance(0)  # started: the bar shows before the first file is stored
        for job in jobs:
            job.listener = advance
            self.run(job)
            if job.state is MigrationState.FAILED:
                return replace(
                    job.status(self._clock()), rank=None, bytes_total=total, bytes_done=advance.done
                )
        return replace(jobs[-1].status(self._clock()), rank=None, bytes_total=total, bytes_done=total)

    def run(self, job: Job) -> None:
        """Run one job to its end state on this thread, recording (never raising) failure."""
        if self._upload(job):
            self._finish(job)

    def _upload(self, job: Job) -> bool:
        """A job's uploads and mark; ``True`` if its cold commit is still to run (the job has
        not ended), else it ended (uploaded, found delivered, or failed)."""
        job.state = MigrationState.UPLOADING
        try:
            if job.stopped:
                raise JobFailed(job.rank, None, "stopped before it started")
            self._breaker.check()
            if not job.fresh and self._delivered_already(job):
                job.state = MigrationState.COMMITTED if job.manifest is not None else MigrationState.UPLOADED
                job.finished = self._clock()
                return False
            self._upload_rank(job)
            if job.manifest is not None:
                return True
            job.state = MigrationState.UPLOADED
            self.cold_answered()
            log.info("migrated %s rank %d to %s (uploaded)", job.name, job.rank, self.cold.label)
        except JobFailed as failure:
            self._record_failure(job, failure)
        except Exception as err:  # unexpected: still never into training
            self._record_failure(job, JobFailed(job.rank, None, err))
        job.finished = self._clock()
        return False

    def _finish(self, job: Job) -> None:
        """A job's cold commit, once its uploads are done."""
        assert job.manifest is not None
        try:
            self._commit(job.manifest, job)
            job.state = MigrationState.COMMITTED
            self._jobs.deliver(job.name, job.attempt)
            self.cold_answered()
            log.info("migrated %s rank %d to %s (committed)", job.name, job.rank, self.cold.label)
        except JobFailed as failure:
            self._record_failure(job, failure)
        except Exception as err:  # unexpected: still never into training
            self._record_failure(job, JobFailed(job.rank, None, err))
        finally:
            job.finished = self._clock()

    def _delivered_already(self, job: Job) -> bool:
        """Whether the hot tier records this attempt as committed in this cold tier (its
        migrated mark naming the cold tier's identity): delivered by another migrator, and
        perhaps pruned from the cold tier by its policy since. A job that is not its writer's
        own asks before it uploads anything (invariant 25): no cold request unless the hot
        tier holds a migrated mark of the attempt."""
        try:
            if next(iter(self.hot.backend.list(layout.migrated_prefix(job.name, job.attempt))), None) is None:
                return False
            cold_id = marks.store_id(self.cold)
            delivered = cold_id is not None and self.hot.backend.exists(
                layout.migrated_key(job.name, job.attempt, cold_id)
            )
        except TierstoreError as err:
            log.debug("could not tell whether %s was delivered already: %s", job.name, err)
            return False
        faults.point("migrator.after_delivered_check")
        if delivered:
            self._jobs.deliver(job.name, job.attempt)
            log.info("%s (attempt %s) was delivered to %s already", job.name, job.attempt, self.cold.label)
        return delivered

    def _record_failure(self, job: Job, failure: JobFailed) -> None:
        job.state = MigrationState.FAILED
        if isinstance(failure.error, JobStopped) or (job.stopped and failure.rank is not None):
            failure = JobFailed(
                None, None, "stopped: the process gave up on it (close() ran out of time, or it is exiting)"
            )
        job.error = (
            f"{type(failure.error).__name__}: {failure.error}"
            if isinstance(failure.error, BaseException)
            else str(failure.error)
        )
        job.failed_rank, job.failed_file = failure.rank, failure.file
        job.retryable = _worth_retrying(failure.error) and not job.stopped
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
        if isinstance(failure.error, TransientStorageError) and not job.error.startswith(
            "TransientStorageError: not attempted"
        ):
            self._breaker.open(job.error)
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
        errors = in_parallel(
            [functools.partial(self._upload_file, job, entry, versions) for entry in job.files],
            self.config.concurrency,
        )
        for error in errors:
            if error is not None:
                raise error if isinstance(error, JobFailed) else JobFailed(job.rank, None, error)
        faults.point("migrator.before_mark_publish")

        def publish() -> None:
            marks.publish_upload_mark(self.cold, job.name, job.attempt, job.rank, job.files, versions)

        try:
            self.config.retry.call(
                publish, what=f"upload mark of rank {job.rank} ({job.name})", sleep=self._sleep
            )
        except Exception as err:
            raise JobFailed(job.rank, None, err) from err
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

            def attempt() -> None:
                def sent(n: int) -> None:
                    job.check_stopped()  # a stopped job ends at its next chunk

                # Only bytes the cold tier acknowledged count (copy_file's progress): once
                # per file, when its object is stored whole; a retry has counted nothing.

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
                    progress=job.add_bytes,
                    sent=sent,
                )

            self.config.retry.call(attempt, what=f"upload of {entry.path} ({job.name})", sleep=self._sleep)
            faults.point("migrator.after_file_upload")
        except Exception as err:
            raise JobFailed(job.rank, entry.path, err) from err


def _worth_retrying(error: BaseException | str) -> bool:
    """Whether another try of a job that failed with ``error`` may succeed: the cold tier
    down, refusing or full, a rank that has not marked yet, bytes that changed since their
    upload (uploaded again); not a conflicting attempt in cold, a damaged hot copy, a bad
    option or a refused type, which stay until a person acts."""
    if isinstance(error, JobStopped):
        return False
    if isinstance(error, CheckpointExists | ConfigError | PermissionError | UnsafeType):
        return False
    if isinstance(error, IntegrityError):
        return "not in the cold tier as uploaded" in str(error)  # the cold copy: uploaded again
    return True
