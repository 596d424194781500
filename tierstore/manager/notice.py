"""A manager's handling of a preemption notice (:mod:`tierstore.manager.preemption`, 3 to 5):
the save of the step the loop is at, its push to the cold tier within the grace period, the
deadline every later wait keeps to, and the end of the process the signal would have ended."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from tierstore.errors import SaveFailed
from tierstore.format import layout
from tierstore.manager.preemption import PreemptionReport, PreemptionWatch, push_to_cold
from tierstore.manager.signals import end_process
from tierstore.migration.migrator import Migrator
from tierstore.options import PreemptionOptions

__all__ = ["NoticeHandler"]

log = logging.getLogger(__name__)


class NoticeHandler:
    """What a manager does on a preemption notice under ``options`` (``None``: preemption off,
    and every method does nothing).

    ``report`` is what the save on the notice managed (:class:`PreemptionReport`), once it ran.
    """

    def __init__(self, options: PreemptionOptions | None) -> None:
        self.watch = PreemptionWatch(options) if options is not None else None
        self.report: PreemptionReport | None = None
        self.acted = False  # a save acted on a notice

    @property
    def preempted(self) -> bool:
        """Whether a save acted on a notice; reading it once it is ``True`` hands the end of the
        run to the loop (:meth:`CheckpointManager.preempted`)."""
        if self.acted and self.watch is not None:
            self.watch.take_over()
        return self.acted

    def seen(self) -> float | None:
        """Seconds since the earliest request on any rank; ``None`` if there is none (or one
        was acted on already). A collective on more than one rank: every ``save()`` calls it."""
        if self.watch is None or self.acted:
            return None
        return self.watch.seen()

    def in_grace(self) -> bool:
        """A notice came, here or on any rank (acted on or not), and its grace period runs."""
        return self.watch is not None and self.watch.in_grace()

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        """The manager acts on a notice (its save and push, ``close()``): the watchdog waits."""
        watch = self.watch
        if watch is None:
            yield
            return
        before, watch.acting = watch.acting, True
        try:
            yield
        finally:
            watch.acting = before

    def close_deadline(self, deadline: float) -> float:
        """``close()``'s deadline: no later than the grace period's, less the exit margin,
        while one runs (a signal that comes during close() shortens it from then on)."""
        if not self.in_grace():
            return deadline
        assert self.watch is not None
        return min(deadline, self.watch.until())

    def end_if_ignored(self, close: Callable[[], None]) -> None:
        """The loop went on after a notice without reading ``preempted``: end the run
        (``close()``, within what is left of the grace period), then the process, as the
        signal would have."""
        watch = self.watch
        if watch is None or not self.acted or watch.taken_over:
            return
        log.warning(
            "preemption notice (%s): the loop went on without stopping on `manager.preempted`; "
            "closing the run",
            watch.signal or "another rank's signal",
        )
        close()  # ends the process once it has closed (end_process_if_signalled)
        self.end_process_if_signalled()

    def end_process_if_signalled(self) -> None:
        """After ``close()``: a notice that came (here, or acted on from any rank) and that
        the loop did not take over ends the process now."""
        watch = self.watch
        if watch is None or watch.taken_over or watch.grace_deadline() is None:
            return
        if not (self.acted or watch.signals.requested_at is not None):
            return
        number = watch.signals.number or watch.options.signals[0]
        end_process(
            number,
            f"preemption notice ({watch.signal or 'another rank'}) and the run closed without the "
            "loop stopping on `manager.preempted`",
        )

    def save(
        self,
        step: int,
        since: float,
        write: Callable[[], None],
        migrators: Callable[[], Sequence[Migrator]],
        *,
        name: str | None = None,
    ) -> float:
        """Save ``step`` now, ``since`` seconds after the signal: ``write()`` commits it in the
        hot tier; then, within the grace period, ``migrators()`` push it to the cold tier.
        Records and logs what it managed as :attr:`report` (checkpoint ``name``, by default
        the step's; :mod:`tierstore.manager.preemption`, 3) and returns the seconds from
        this call to the hot commit. The manager and the torchtitan drop-in both save so."""
        with self.acting():
            return self._save(step, since, write, migrators, name or layout.default_name(step))

    def _save(
        self,
        step: int,
        since: float,
        write: Callable[[], None],
        migrators: Callable[[], Sequence[Migrator]],
        name: str,
    ) -> float:
        watch = self.watch
        assert watch is not None and watch.deadline is not None
        grace = watch.options.grace_seconds
        signalled = time.monotonic() - since
        log.warning(
            "preemption notice (%s): saving step %d now, within the %gs grace period",
            watch.signal or "another rank's signal",
            step,
            grace,
        )
        self.acted = True
        try:
            write()
        except SaveFailed as err:
            self.report = PreemptionReport(
                step, None, watch.signal, grace, time.monotonic() - signalled, "none", None,
                watch.deadline - time.monotonic(), error=str(err),
            )  # fmt: skip
            log.error("%s", self.report.summary())
            raise
        hot_seconds = time.monotonic() - signalled
        cold, ended = push_to_cold(migrators(), step, watch.until())
        self.report = PreemptionReport(
            step, name, watch.signal, grace, hot_seconds, cold,
            None if ended is None else ended - signalled, watch.deadline - time.monotonic(),
        )  # fmt: skip
        log.warning("%s", self.report.summary())
        return hot_seconds - since

    def release(self) -> None:
        """Stop watching: the handlers that were there before are back."""
        if self.watch is not None:
            self.watch.release()
