"""What the migrator works on: its configuration, one rank's share of a checkpoint (a
:class:`Job`) and the status it reports, and the failures a job ends in.

Values and small helpers only; the worker that runs jobs is :mod:`tierstore.migration.migrator`,
its cold commit :mod:`tierstore.migration.cold_commit`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from tierstore.errors import ConfigError
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.retry import RetryPolicy, polling

__all__ = [
    "FILE_RETRY",
    "Job",
    "JobFailed",
    "JobStopped",
    "MigrationOptions",
    "MigrationState",
    "MigrationStatus",
    "files_by_rank",
    "in_parallel",
]


# Whole-file retries on top of the backend's own per-request retries (S3 and GCS retry each
# part and publish themselves): a few, so the two layers do not multiply.
FILE_RETRY = RetryPolicy(attempts=3, deadline=900.0, initial=1.0, maximum=30.0)


@dataclass(frozen=True)
class MigrationOptions:
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
    retryable: bool = True  # a failure another try may cure (Migrator.retry_failed)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(
        cls,
        manifest: Manifest,
        rank: int,
        files: tuple[FileEntry, ...] | None = None,
        *,
        commits: bool = False,
        fresh: bool = False,
    ) -> Job:
        """Rank ``rank``'s job of ``manifest`` (``files``: its files, looked up if not given),
        the cold commit too if it ``commits``."""
        files = manifest.files_of_rank(rank) if files is None else files
        return cls(
            manifest.name,
            manifest.attempt,
            manifest.step,
            rank,
            files,
            manifest.created,
            manifest=manifest if commits else None,
            fresh=fresh,
        )

    def again(self, now: float) -> Job:
        """The same work as a new job, to run after this one failed: it checks what is in
        the cold tier before it uploads (not ``fresh``: the failed try may have left
        objects, marks and a failure mark)."""
        return Job(
            self.name,
            self.attempt,
            self.step,
            self.rank,
            self.files,
            self.created if self.created else now,
            manifest=self.manifest,
            listener=self.listener,
        )

    def check_stopped(self) -> None:
        if self.stopped:
            raise JobStopped(f"migration of {self.name} stopped")

    def add_bytes(self, n: int) -> None:
        self.check_stopped()
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


class JobStopped(Exception):
    """Raised inside a job that :meth:`~tierstore.migration.migrator.Migrator.stop` ended (never retried)."""


class JobFailed(Exception):
    """A job's failure: the rank whose upload failed (``None``: the commit itself) and file."""

    def __init__(self, rank: int | None, file: str | None, error: BaseException | str) -> None:
        super().__init__(str(error))
        self.rank, self.file, self.error = rank, file, error


def files_by_rank(manifest: Manifest) -> dict[int, tuple[FileEntry, ...]]:
    """Each rank's files of ``manifest``, in one pass over them (not one pass per rank)."""
    by_rank: dict[int, list[FileEntry]] = {}
    for entry in manifest.files:
        by_rank.setdefault(entry.rank, []).append(entry)
    return {rank: tuple(files) for rank, files in by_rank.items()}


def in_parallel(calls: Sequence[Callable[[], None]], width: int) -> list[BaseException | None]:
    """Run ``calls`` on up to ``width`` *daemon* threads; each one's exception, or ``None``.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so an upload
    stuck on a stalled cold tier would hold the training process's exit forever, whatever
    ``TIERSTORE_EXIT_WAIT`` says. Daemon threads leave that bound to :mod:`tierstore.migration.workers`.
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
