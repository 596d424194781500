"""What one migrator has queued, runs and delivered: one job per checkpoint (docs/design.md
invariant 25).

A job is keyed by its checkpoint, attempt and rank; a key holds one job that is neither done
nor stopped at a time. An attempt this migrator committed (or found committed) is recorded
as delivered, with when (``time.monotonic()``). Every method is thread-safe; :meth:`wait`
blocks until every job added has ended.
"""

from __future__ import annotations

import logging
import threading
import time

from tierstore.migration.jobs import Job, MigrationState, MigrationStatus

__all__ = ["JobTable"]

log = logging.getLogger(__name__)


class JobTable:
    """The jobs of one migrator, and the attempts it delivered (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str, int], Job] = {}
        self._delivered: dict[tuple[str, str], float] = {}
        self._unfinished = 0
        self._cond = threading.Condition()

    def add(self, job: Job) -> bool:
        """Record ``job``; ``False`` (nothing recorded) if a job of its rank and attempt is
        queued or running already."""
        with self._cond:
            key = (job.name, job.attempt, job.rank)
            current = self._jobs.get(key)
            if current is not None and not current.stopped and not current.done:
                log.debug("%s rank %d is queued or running here already", job.name, job.rank)
                return False
            self._jobs[key] = job
            self._unfinished += 1
        return True

    def ended(self) -> None:
        """A job added has ended (done, failed or stopped)."""
        with self._cond:
            self._unfinished -= 1
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job added has ended; ``False`` if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._unfinished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def deliver(self, name: str, attempt: str) -> None:
        """Record the attempt as delivered, now."""
        with self._cond:
            self._delivered[(name, attempt)] = time.monotonic()

    def forget_delivered(self, name: str, attempt: str) -> None:
        """The attempt is pending again (the cold tier lost it): no longer delivered."""
        with self._cond:
            self._delivered.pop((name, attempt), None)

    def delivered(self, name: str, attempt: str) -> bool:
        with self._cond:
            return (name, attempt) in self._delivered

    def handles(self, name: str, attempt: str, *, since: float | None = None) -> bool:
        """Whether a job of this attempt is queued or running, or the attempt was delivered
        (``since``: at or after that ``time.monotonic()`` value)."""
        with self._cond:
            when = self._delivered.get((name, attempt))
            if when is not None and (since is None or when >= since):
                return True
            return any(
                not job.done and not job.stopped
                for (n, a, _), job in self._jobs.items()
                if (n, a) == (name, attempt)
            )

    def to_retry(self, names: set[str] | None = None) -> list[Job]:
        """The jobs of ``names`` (default: all) that failed for a reason another try may cure,
        were not stopped, and whose attempt is not delivered."""
        with self._cond:
            return [
                job
                for job in self._jobs.values()
                if job.state is MigrationState.FAILED
                and job.retryable
                and not job.stopped
                and (names is None or job.name in names)
                and (job.name, job.attempt) not in self._delivered
            ]

    def stop(self, names: set[str] | None = None) -> None:
        """Mark the jobs of ``names`` (default: all) that have not finished as stopped."""
        with self._cond:
            for job in self._jobs.values():
                if not job.done and (names is None or job.name in names):
                    job.stopped = True

    def status(self, now: float, *, unfinished: bool = False) -> list[MigrationStatus]:
        """Every job's status at ``now`` (``unfinished``: those not done and not stopped)."""
        with self._cond:
            jobs = [
                job for job in self._jobs.values() if not unfinished or (not job.done and not job.stopped)
            ]
        return [job.status(now) for job in jobs]
