"""The end of a run: waiting for the last save and delivering its checkpoints, boundedly, or
saying which it did not (docs/design.md invariant 22)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError
from typing import TypeVar

import torch.distributed as dist

from tierstore.errors import MigrationFailed, SaveFailed, TierstoreError
from tierstore.manager.base import Base
from tierstore.migration.delivery import (
    PROBE_WAIT,
    await_delivery,
    deliver,
    describe,
    undelivered,
)

__all__ = ["Ending"]

log = logging.getLogger(__name__)
_M = TypeVar("_M", bound="Ending")


class Ending(Base):
    """Ending of :class:`~tierstore.manager.CheckpointManager` (module docstring)."""

    def wait(self, *, migrations: bool = True, timeout: float | None = None) -> None:
        """Wait for the last save; by default also for its pruning and this process's
        migrations (up to ``timeout`` seconds in all). ``migrations=False`` waits for the
        save alone, and so never for the cold tier.

        With a ``timeout``, the wait is spent trying (docs/design.md invariant 26): a
        migration that failed for a reason another try may cure is tried again each time
        the cold tier answers, until the timeout; a cold tier that answers nothing for 10 s
        in a row is not waited for. Without one, each migration is waited for once.

        Raises :class:`~tierstore.errors.SaveFailed` for a failed save not raised before, then
        :class:`~tierstore.errors.MigrationFailed` for checkpoints whose migration failed
        and that are still pending (not the cold tier's since, nor delivered and pruned
        since), each once. Pruning errors are not raised: see :meth:`health`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._finish_previous()
        if migrations:
            pruning = self._rounds.running()
            if pruning is not None:
                try:
                    pruning.result(_left(deadline))
                except TimeoutError:
                    log.warning("pruning still running after %ss (the cold tier is slow?)", timeout)
            self._deliver(deadline)
        self._raise_failure()
        if migrations:
            failed = {
                name: why
                for name, why in self._undelivered(deadline).items()
                if name not in self._reported and not why.startswith("still ")
            }
            self._reported.update(failed)
            if failed:
                raise self._migration_failed(failed)

    def close(self, *, timeout: float | None = None) -> None:
        """End the run: wait for the last save, deliver its checkpoints to the cold tier,
        prune once more, release the group (docs/design.md invariant 22). After a save on a
        preemption notice, within what is left of its grace period, and without the prune.

        Everything waits against one deadline, ``timeout`` seconds from now (default: the
        manager's ``close_timeout``, 300 s), logging what it waits for, and the deadline is
        spent trying (invariant 26): a migration that failed for a reason another try may
        cure (the cold tier down for a while, refusing, throttling) is tried again each time
        the cold tier answers a probe. A cold tier that answers nothing for 10 s in a row is
        not waited for any longer (after a preemption notice it is, until the grace
        deadline). What has not reached the cold tier by then is stopped (nothing of it
        runs after close returns) and stays committed and pending in the hot tier; close
        says so at ERROR, naming each checkpoint and how it will be finished (the next
        job's manager, or ``tierstore migrate``), and raises
        :class:`~tierstore.errors.MigrationFailed` after releasing everything. A failed save
        raises :class:`~tierstore.errors.SaveFailed` instead (it comes first), as
        :meth:`wait` does.

        A signal that comes during close(), or after the last save, bounds it by its grace
        period from then on. A preemption notice the loop did not take over (it never read
        ``preempted`` once the notice's save had returned) ends the process once close is
        done, as the signal would have without the manager (docs/training-state.md).
        """
        with self._acting():  # a preemption watchdog waits for it
            self._close(timeout)

    def _close(self, timeout: float | None) -> None:
        """``close()``, with the watchdog waiting."""
        ends = time.monotonic() + (self.close_timeout if timeout is None else timeout)

        def deadline_now() -> float:  # a signal that comes during close() shortens it
            return self._close_deadline(ends)

        failure: TierstoreError | None = None
        self._finish_previous()  # the last save (hot only: it never waits on the cold tier)
        if self._deliver(deadline_now) is not None:
            ends, self._cold_down = time.monotonic(), True
        deadline = deadline_now()
        try:
            self.wait(timeout=_left(deadline))
        except SaveFailed as err:
            failure = err
        except MigrationFailed:
            pass  # named again below, with whatever else is left
        self._closing = True
        deadline = deadline_now()
        if (self.rank == 0 or self.node_local) and not self._cold_down and not self._in_grace():
            # Now that migrations drained, hot copies kept only as pending can go.
            try:  # joins a running round, which then runs one more
                self._prune_in_background().result(_left(deadline, floor=0.0))
            except TimeoutError:
                log.warning("final pruning still running at close's deadline; left to the next run")
        undelivered = self._undelivered(deadline_now())
        for migrator in self._migrators():
            migrator.stop(set(undelivered))  # nothing of them runs once close returns
        if undelivered:
            late = self._migration_failed(undelivered)
            log.error("%s", late)
            failure = failure or late
        self._release()
        self._end_process_if_signalled()  # a notice the loop did not take over: as the signal would
        if failure is not None:
            raise failure

    def _deliver(self, deadline: float | Callable[[], float] | None) -> str | None:
        """This process's migrations, until ``deadline``: waited for once without one, else
        tried again while the cold tier answers (:func:`~tierstore.migration.delivery.deliver`);
        a cold tier that answers nothing for ``PROBE_WAIT`` seconds in a row is given up on
        (after a preemption notice, not before the grace deadline): returns why."""
        cold, migrators = self.store.cold, self._migrators()
        if cold is None or not migrators or self._cold_down:
            return None
        if deadline is None:
            await_delivery(migrators, None)
            return None
        why = deliver(migrators, cold, deadline, give_up_after=None if self._in_grace() else PROBE_WAIT)
        if why is not None:
            log.error(
                "the cold tier %s is unreachable (%s): its migrations are not waited for any longer",
                cold.label,
                why,
            )
        return why

    def _release(self) -> None:
        if self._thread is not None:  # idle: wait() above saw its last save settle
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._stager is not None:  # frees the staging buffers; a later save makes new ones
            self._stager.close()
            self._stager = None
        if self._owns_group and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if self._run_lock is not None:
            self._run_lock.release()
        self._release_watch()

    def _undelivered(self, deadline: float | None) -> dict[str, str]:
        cold = self.store.cold
        if cold is None:
            return {}
        # Looking each one up in the cold tier: bounded even when close's time is spent, and
        # not at all in a cold tier close() found unreachable.
        # After a preemption notice, the grace period bounds the lookups too.
        floor = 0.0 if self._in_grace() else 5.0
        lookup = 0.0 if self._cold_down else 30.0 if deadline is None else _left(deadline, floor=floor)
        return undelivered(
            self._migrators(), cold, timeout=lookup, catalog=self.rank == 0 or not self.node_local
        )

    def _migration_failed(self, failures: dict[str, str]) -> MigrationFailed:
        assert self.store.cold is not None
        return MigrationFailed(
            describe(failures, self._hot, self.store.cold), checkpoints=tuple(failures), errors=failures
        )

    def __enter__(self: _M) -> _M:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is on its way out already: it is the one to raise
            self.close()
        except TierstoreError as err:
            log.error("while closing on %s: %s", exc_type.__name__, err)


def _left(deadline: float | None, *, floor: float = 0.0) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), at least ``floor``."""
    return None if deadline is None else max(floor, deadline - time.monotonic())
