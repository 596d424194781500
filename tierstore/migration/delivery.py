"""Delivering a run's checkpoints to the cold tier: resuming what is pending, and the end of
a run (docs/design.md invariants 22, 25 and 26).

A checkpoint committed in the hot tier and not in the cold tier is pending (invariant 12);
whatever left it so (a killed run, a cold tier that was down, a migration that failed), the
next process that can finish it should, without waiting for a person to run
``tierstore migrate``. And a run's end either delivers its last checkpoints or says, loudly
and in bounded time, which ones it did not:

* :func:`resume_pending` queues a full migration of each pending checkpoint that this
  process's migrator is not already working on and has not delivered (``CheckpointManager``
  calls it at start and after each commit, from the pending set its prune computed anyway);
* :func:`deliver` spends a deadline trying: it waits for a process's migrators and, each
  time the cold tier answers a probe, queues again what failed for a reason another try may
  cure (``close()``, ``wait(timeout=)``, the preemption push); a cold tier that answers
  nothing for ``PROBE_WAIT`` seconds in a row is given up on where the caller says so;
* :func:`await_delivery` waits for a process's migrators until a deadline, telling the log
  every ``PROGRESS_EVERY`` seconds what it waits for;
* :func:`undelivered` says which checkpoints this process handed to its migrators are
  really pending now, and why: not one the cold tier holds (another process may have
  committed it since), nor one delivered and pruned by the cold policy since, nor one the
  hot tier no longer holds.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from tierstore._redact import redact_url
from tierstore.errors import TierstoreError
from tierstore.migration.migrator import MigrationState, MigrationStatus, Migrator
from tierstore.migration.probe import PROBE_WAIT, unreachable
from tierstore.storage import faults
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier

__all__ = [
    "resume_pending",
    "deliver",
    "await_delivery",
    "undelivered",
    "describe",
    "unreachable",
    "PROGRESS_EVERY",
    "PROBE_WAIT",
    "RETRY_PAUSE",
    "Deadline",
]

log = logging.getLogger(__name__)

PROGRESS_EVERY = 30.0  # seconds between "still waiting for ..." lines
RETRY_PAUSE = 1.0  # seconds between two looks at a cold tier that did not answer
_ACTIVE = (MigrationState.PENDING, MigrationState.UPLOADING)


def resume_pending(
    migrator: Migrator, hot: Tier, pending: Iterable[str], *, since: float | None = None
) -> list[str]:
    """Queue a full migration (every rank's files, from ``hot``) of each hot checkpoint named
    in ``pending`` that ``migrator`` is not already working on and has not delivered; return
    the names queued. Needs a hot tier that holds every rank's files (not node-local).

    ``pending`` was computed before this call (a prune round's cold check, which began at
    ``since``, a ``time.monotonic()`` value): a migration of one of them may have committed
    since. The migrator refuses an attempt it handles or delivered after ``since`` (one it
    delivered before the check that still found it pending was lost by the cold tier),
    and a job it runs asks the hot tier first whether another migrator delivered it
    (invariant 25)."""
    wanted = set(pending)
    if not wanted:
        return []
    faults.point("delivery.before_queue")  # the pending set is a view of the past: gated
    queued = [
        manifest.name
        for manifest in hot.manifests()
        if manifest.name in wanted and migrator.submit_checkpoint(manifest, since=since)
    ]
    if queued:
        log.info(
            "resuming the migration of %s to %s (pending in %s)",
            ", ".join(sorted(queued)),
            migrator.cold.label,
            hot.label,
        )
    return queued


Deadline = float | Callable[[], float] | None  # a time.monotonic() value, or what gives it now


def _now(deadline: Deadline) -> float | None:
    return deadline() if callable(deadline) else deadline


def _passed(deadline: Deadline) -> bool:
    now = _now(deadline)
    return now is not None and time.monotonic() >= now


def _sooner(deadline: Deadline, bound: float) -> float:
    now = _now(deadline)
    return bound if now is None else min(now, bound)


def deliver(
    migrators: Sequence[Migrator],
    cold: Tier,
    deadline: Deadline,
    *,
    names: set[str] | None = None,
    give_up_after: float | None = PROBE_WAIT,
) -> str | None:
    """Spend until ``deadline`` (a ``time.monotonic()`` value; ``None``: no bound) getting
    the jobs of ``names`` (default: all) of ``migrators`` done (invariant 26).

    Each round asks the cold tier one listing (bounded by ``PROBE_WAIT``). If it answers,
    the migrators' breakers close, every job that failed for a reason another try may cure
    is queued again (:meth:`Migrator.retry_failed`), and the round waits for the jobs, at
    most ``PROBE_WAIT`` seconds, before it looks again. If it does not answer, the round
    pauses ``RETRY_PAUSE`` seconds; once it has answered nothing for ``give_up_after``
    seconds in a row (``None``: never, until the deadline) the wait ends. Returns why the
    cold tier was given up on, or ``None`` (nothing left to try, or the deadline came).
    """
    due = deadline
    down_since: float | None = None
    while True:
        if not _work_left(migrators, names):
            return None
        started, deadline = time.monotonic(), _now(due)  # it may move closer: a signal came
        if deadline is not None and started >= deadline:
            return None
        wait = PROBE_WAIT if deadline is None else min(PROBE_WAIT, deadline - started)
        why = unreachable(cold, wait, give_up=functools.partial(_passed, due))
        if why is not None:
            down_since = started if down_since is None else down_since
            if give_up_after is not None and time.monotonic() - down_since >= give_up_after:
                return why
            _rest(due)
            continue
        down_since = None
        retried = []
        for migrator in migrators:
            migrator.cold_answered()
            retried += migrator.retry_failed(names)
        if retried:
            log.info("trying the migration of %s to %s again", ", ".join(sorted(set(retried))), cold.label)
        await_delivery(migrators, functools.partial(_sooner, due, time.monotonic() + PROBE_WAIT), names=names)
        if not _unfinished(migrators, names) and _work_left(migrators, names):
            # Every job tried has ended, some failed again (another rank's failure mark, a
            # refusal): a pause before the next look, not a busy loop.
            _rest(due)


def _rest(deadline: Deadline) -> None:
    """Pause ``RETRY_PAUSE`` seconds, or until ``deadline`` (which may move closer)."""
    ends = time.monotonic() + RETRY_PAUSE
    while not _passed(deadline) and (left := ends - time.monotonic()) > 0:
        time.sleep(min(0.1, left))


def _work_left(migrators: Sequence[Migrator], names: set[str] | None) -> bool:
    return bool(_unfinished(migrators, names)) or any(m.to_retry(names) for m in migrators)


def await_delivery(
    migrators: Sequence[Migrator], deadline: Deadline, *, names: set[str] | None = None
) -> bool:
    """Wait for the jobs of ``names`` (default: all) of ``migrators`` until they are idle
    (``True``) or ``deadline`` (a ``time.monotonic()`` value, or a callable giving it now)
    passes (``False``), logging what is left every :data:`PROGRESS_EVERY` seconds."""
    due = deadline
    while True:
        left = _unfinished(migrators, names)
        if not left:
            return True
        now, deadline = time.monotonic(), _now(due)
        if deadline is not None and now >= deadline:
            return False
        step = PROGRESS_EVERY if deadline is None else min(PROGRESS_EVERY, deadline - now)
        ends = now + step
        while _unfinished(migrators, names) and time.monotonic() < min(ends, _now(due) or ends):
            for m in migrators:  # a job ends, the step does, or the deadline moves closer
                m.wait(min(0.5, max(0.0, ends - time.monotonic())))
        left = _unfinished(migrators, names)
        if left and time.monotonic() >= now + PROGRESS_EVERY - 0.5:
            lag = sum(s.lag_bytes for s in left)
            more = "" if deadline is None else f", up to {max(0.0, deadline - time.monotonic()):.0f}s more"
            log.warning(
                "waiting for the migration of %s to %s (%.1f MiB left%s)",
                ", ".join(sorted({s.name for s in left})),
                migrators[0].cold.label,
                lag / 2**20,
                more,
            )


def _unfinished(migrators: Sequence[Migrator], names: set[str] | None = None) -> list[MigrationStatus]:
    return [s for m in migrators for s in m.pending() if names is None or s.name in names]


def undelivered(
    migrators: Sequence[Migrator], cold: Tier, *, timeout: float | None, catalog: bool = True
) -> dict[str, str]:
    """The checkpoints ``migrators`` were given that are really pending now, each with why
    (a job that failed, or one not finished).

    An attempt a migrator delivered, or found delivered, is not; nor, looked up within
    ``timeout`` seconds in all (a name whose lookup does not come back in time is
    reported), one the cold tier holds now (another migrator, or a later job, committed
    it), nor, where the migrators' hot tier holds the run's manifests (``catalog``: not a
    node-local rank other than the coordinator), one whose hot manifest is gone or names
    another attempt, or that the hot tier records as committed in this cold tier (the
    cold policy pruned it since).
    """
    latest: dict[str, tuple[Migrator, MigrationStatus]] = {}
    for migrator in migrators:
        for status in migrator.status():
            wanted = status.state in _ACTIVE or status.state is MigrationState.FAILED
            if wanted and not migrator.delivered(status.name, status.attempt):
                latest.setdefault(status.name, (migrator, status))
    if not latest:
        return {}
    found: dict[str, bool] = {}

    def look() -> None:
        cold_id: str | None = None
        try:
            cold_id = marks.store_id(cold)
        except TierstoreError:
            pass
        for name, (migrator, status) in latest.items():
            found[name] = _delivered(migrator.hot, cold, cold_id, status, catalog=catalog)

    looker = threading.Thread(target=look, name="tierstore-delivery-check", daemon=True)
    looker.start()
    looker.join(timeout)
    return {name: _why(status) for name, (_, status) in sorted(latest.items()) if not found.get(name, False)}


def _delivered(hot: Tier, cold: Tier, cold_id: str | None, status: MigrationStatus, *, catalog: bool) -> bool:
    """Whether ``status``'s attempt is not pending: in the cold tier, or (``catalog``) gone
    from the hot tier or marked there as committed in this cold tier."""
    try:
        there = cold.find_manifest(status.name)
        if there is not None and there.attempt == status.attempt:
            return True
    except TierstoreError:
        pass  # a damaged or unreadable cold manifest: the hot tier may still tell
    if not catalog:
        return False
    try:
        here = hot.find_manifest(status.name)
        if here is None or here.attempt != status.attempt:
            return True  # nothing of it is left to deliver from this hot tier
        return marks.was_migrated(hot, here, cold_id)
    except TierstoreError:
        return False


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
