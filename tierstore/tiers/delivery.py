"""Delivering a run's checkpoints to the cold tier: resuming what is pending, and the end of
a run (docs/design.md invariant 22).

A checkpoint committed in the hot tier and not in the cold tier is pending (invariant 12);
whatever left it so (a killed run, a cold tier that was down, a migration that failed), the
next process that can finish it should, without waiting for a person to run
``tierstore migrate``. And a run's end either delivers its last checkpoints or says, loudly
and in bounded time, which ones it did not:

* :func:`resume_pending` queues a full migration of each pending checkpoint that this
  process's migrator is not already working on (``CheckpointManager`` calls it at start and
  after each commit, from the pending set its prune computed anyway);
* :func:`await_delivery` waits for a process's migrators until a deadline, telling the log
  every ``PROGRESS_EVERY`` seconds what it waits for;
* :func:`undelivered` says which checkpoints this process handed to its migrators and are
  not in the cold tier, and why, asking the cold tier itself before it accuses one (another
  process may have committed it since).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

from tierstore._redact import redact_url
from tierstore.errors import StorageError, TierstoreError
from tierstore.format import layout
from tierstore.tiers.migrator import MigrationState, MigrationStatus, Migrator
from tierstore.tiers.tier import Tier

__all__ = [
    "resume_pending",
    "await_delivery",
    "undelivered",
    "describe",
    "unreachable",
    "PROGRESS_EVERY",
    "PROBE_WAIT",
]

log = logging.getLogger(__name__)

PROGRESS_EVERY = 30.0  # seconds between "still waiting for ..." lines
PROBE_WAIT = 10.0  # seconds the end of a run gives the cold tier to answer one listing
_PROBE_THREAD = "tierstore-cold-probe"
_DONE = (MigrationState.UPLOADED, MigrationState.COMMITTED)


def resume_pending(migrator: Migrator, hot: Tier, pending: Iterable[str]) -> list[str]:
    """Queue a full migration (every rank's files, from ``hot``) of each hot checkpoint named
    in ``pending`` that ``migrator`` is not already working on; return the names queued.
    Needs a hot tier that holds every rank's files (not node-local)."""
    wanted = set(pending)
    if not wanted:
        return []
    queued = []
    for manifest in hot.manifests():
        if manifest.name in wanted and not migrator.busy(manifest.name, manifest.attempt):
            migrator.submit_checkpoint(manifest)
            queued.append(manifest.name)
    if queued:
        log.info(
            "resuming the migration of %s to %s (pending in %s)",
            ", ".join(sorted(queued)),
            migrator.cold.label,
            hot.label,
        )
    return queued


def await_delivery(migrators: Sequence[Migrator], deadline: float | None) -> bool:
    """Wait for ``migrators`` until they are idle (``True``) or ``deadline`` (a
    ``time.monotonic()`` value) passes (``False``), logging what is left every
    :data:`PROGRESS_EVERY` seconds."""
    while True:
        left = _unfinished(migrators)
        if not left:
            return True
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        step = PROGRESS_EVERY if deadline is None else min(PROGRESS_EVERY, deadline - now)
        ends = now + step
        while _unfinished(migrators) and time.monotonic() < ends:  # a job ends, or the step does
            for m in migrators:
                m.wait(min(0.5, max(0.0, ends - time.monotonic())))
        left = _unfinished(migrators)
        if left:
            lag = sum(s.lag_bytes for s in left)
            more = "" if deadline is None else f", up to {max(0.0, deadline - time.monotonic()):.0f}s more"
            log.warning(
                "waiting for the migration of %s to %s (%.1f MiB left%s)",
                ", ".join(sorted({s.name for s in left})),
                migrators[0].cold.label,
                lag / 2**20,
                more,
            )


def _unfinished(migrators: Sequence[Migrator]) -> list[MigrationStatus]:
    return [s for m in migrators for s in m.pending()]


def undelivered(migrators: Sequence[Migrator], cold: Tier, *, timeout: float | None) -> dict[str, str]:
    """The checkpoints ``migrators`` were given that are not (known to be) in the cold tier
    now, each with why: a job that failed, or one not finished. One that the cold tier
    holds now (another migrator, or a later job, committed it) is not accused: each is
    looked up there, within ``timeout`` seconds in all (a name whose lookup does not come
    back in time is reported)."""
    latest: dict[str, MigrationStatus] = {}
    for status in (s for m in migrators for s in m.status()):
        if status.state not in _DONE:
            latest.setdefault(status.name, status)
    if not latest:
        return {}
    found: dict[str, bool] = {}

    def look() -> None:
        for name, status in latest.items():
            try:
                there = cold.find_manifest(name)
            except TierstoreError:
                there = None
            found[name] = there is not None and there.attempt == status.attempt

    looker = threading.Thread(target=look, name="tierstore-delivery-check", daemon=True)
    looker.start()
    looker.join(timeout)
    return {name: _why(status) for name, status in sorted(latest.items()) if not found.get(name, False)}


def _why(status: MigrationStatus) -> str:
    if status.state is MigrationState.FAILED:
        return status.error or "failed"
    return (
        f"still {status.state.value} ({status.bytes_done} of {status.bytes_total} bytes) "
        "when the wait ran out"
    )


def describe(failures: dict[str, str], hot: Tier, cold: Tier) -> str:
    """One message naming what stays undelivered, where it is, and what finishes it."""
    names = ", ".join(failures)
    reasons = "; ".join(f"{name}: {why}" for name, why in failures.items())
    return (
        f"checkpoint(s) {names} did not reach the cold tier {cold.label} ({reasons}). "
        f"Nothing is lost: they stay committed and pending in the hot tier {hot.label}; "
        f"the next job's CheckpointManager with these tiers resumes their migration, or run "
        f"`tierstore migrate --hot {redact_url(hot.url)} --cold {redact_url(cold.url)}`"
    )


class _ProbeRetries(logging.Filter):
    """Keeps the probe's retry warnings out of the log, remembering the last error: the
    outcome is reported in one line (a probe left behind may retry long after)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName != _PROBE_THREAD:
            return True
        error = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        if isinstance(error, BaseException):
            self.last = error.message if isinstance(error, TierstoreError) else str(error)
        return False


_PROBE_RETRIES = _ProbeRetries()
logging.getLogger("tierstore.retry").addFilter(_PROBE_RETRIES)


def unreachable(cold: Tier, wait: float) -> str | None:
    """Why ``cold`` cannot be listed within ``wait`` seconds; ``None`` if it can.

    The listing runs on a daemon thread, left behind if it has not returned by then: a
    backend's own retries and timeouts (minutes, for S3) suit an upload that may succeed,
    not a question asked at a prompt or at the end of a run. Errors other than storage
    errors (a bad URL or option) are the caller's to fix and are raised.
    """
    box: dict[str, BaseException | bool] = {}

    def probe() -> None:
        try:
            next(iter(cold.backend.list(layout.manifests_prefix())), None)
            box["ok"] = True
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    _PROBE_RETRIES.last = None
    thread = threading.Thread(target=probe, name=_PROBE_THREAD, daemon=True)
    thread.start()
    thread.join(wait)
    error = box.get("error")
    if isinstance(error, StorageError):
        return f"{type(error).__name__}: {error.message}"
    if isinstance(error, BaseException):
        raise error
    if box.get("ok"):
        return None
    last = _PROBE_RETRIES.last
    return f"no answer within {wait:g} s" + (f"; last error: {last}" if last else "")
