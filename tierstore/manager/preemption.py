"""Preemption: a scheduler's notice (a signal, then a grace period before SIGKILL) turned into
one last checkpoint of the step the loop is at, in the hot tier and, within the grace period,
in the cold tier.

The protocol, on every rank:

1. **The handler only records.** :class:`SignalWatch` installs a handler for each of
   :class:`~tierstore.Preemption`'s signals that notes the first request's time and calls the
   handler that was there before it if that is a Python function. It does nothing else: a
   signal handler runs between two bytecodes of whatever the main thread was doing (holding
   the logging lock, or inside a collective), so it takes no lock and starts no I/O. The
   default action (ending the process) is not taken: the loop decides when to stop.
2. **Every ``save()`` combines the request across ranks**, the cadence's skipped steps
   included: one all-reduce (MAX) of "seconds since the signal, or -1" on a gloo group of the
   manager's own (DCP's async saves run collectives on the save group from a background
   thread; this one must never interleave with them). One rank's signal is so every rank's,
   at the same ``save()`` call, and every rank counts its deadline from the earliest signal.
3. **The save that sees it saves** that step whatever the cadence says: it waits for a save
   in flight (a failure of that one is logged, not raised: the new save is what matters now),
   saves synchronously so the hot commit is known when it returns, then waits for this
   process's migrations up to the grace deadline less :data:`EXIT_MARGIN`, and records what
   it managed in :attr:`Preempting.preemption` (a :class:`PreemptionReport`, also logged at
   WARNING). ``save()`` returns ``True`` and ``preempted`` is ``True`` on every rank, so
   ``if manager.save(step, state) and manager.preempted: break`` stops every rank at one step.
4. **``close()`` keeps to the same deadline** and skips the final prune (the next run prunes);
   it releases the handlers, re-installing the ones that were there before.

Off with ``CheckpointManager(preemption=False)``. A manager built outside the main thread
cannot install handlers (Python allows it only there): it says so at WARNING and saves as
if preemption were off.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from tierstore.errors import ConfigError, SaveFailed
from tierstore.format import layout
from tierstore.manager.base import Base
from tierstore.options import Preemption

__all__ = ["SignalWatch", "PreemptionReport", "Preempting", "EXIT_MARGIN", "preemption_options"]

log = logging.getLogger(__name__)

# Seconds of the grace period kept back for what follows the push to the cold tier: close(),
# the loop's own exit, interpreter shutdown. A tenth of the grace period, at most this.
EXIT_MARGIN = 3.0

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def preemption_options(preemption: Preemption | bool) -> Preemption | None:
    """``CheckpointManager(preemption=)``: ``True`` is ``Preemption()``, ``False`` is off."""
    if preemption is True:
        return Preemption()
    if preemption is False:
        return None
    if isinstance(preemption, Preemption):
        return preemption
    raise ConfigError(
        f"CheckpointManager(preemption=) takes True, False or a Preemption, got {type(preemption).__name__}"
    )


class SignalWatch:
    """Handlers for ``signals`` that record the first request (module docstring, 1)."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.requested_at: float | None = None  # time.monotonic() of the first request
        self.signal: str | None = None  # its name
        self._previous: dict[int, _Handler] = {}
        self._active = True
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointManager built outside the main thread: it cannot watch %s for a "
                "preemption notice (Python installs signal handlers only in the main thread); "
                "build it in the main thread, or save on preemption yourself",
                "/".join(signal.Signals(s).name for s in signals),
            )
            return
        for number in signals:
            self._previous[number] = signal.signal(number, self._handle)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self._active and self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal = signal.Signals(number).name
        previous = self._previous.get(number)
        if callable(previous):  # a handler of the user's, or of a manager built before
            previous(number, frame)

    def seconds_since(self) -> float:
        """Seconds since the first request; -1 if none came."""
        return -1.0 if self.requested_at is None else time.monotonic() - self.requested_at

    def release(self) -> None:
        """Stop recording; put back each handler that was there before, where ours is still
        the one installed (one installed after ours keeps calling ours, which now only
        passes the signal on)."""
        self._active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._handle and previous is not None:
                signal.signal(number, previous)


@dataclass(frozen=True)
class PreemptionReport:
    """What the save on a preemption notice managed (on this rank)."""

    step: int
    checkpoint: str | None  # None: the save failed
    signal: str | None  # the signal this rank got; None where another rank's was heard
    grace_seconds: float
    hot_seconds: float  # from the (earliest) signal to the hot commit
    cold: str  # "committed", "uploaded" (this rank's files; the coordinator commits), "none", or why not
    cold_seconds: float | None  # from the signal to the end of the push, if one was made
    seconds_left: float  # of the grace period, when the push ended
    error: str | None = None  # why the save failed

    @property
    def saved(self) -> bool:
        return self.checkpoint is not None

    def summary(self) -> str:
        heard = f"{self.signal}" if self.signal else "another rank's preemption notice"
        if not self.saved:
            return f"preempted ({heard}): the save of step {self.step} failed: {self.error}"
        after = f"{self.cold_seconds:.2f}s after the signal" if self.cold_seconds is not None else ""
        cold = {
            "committed": f"committed in the cold tier {after}",
            "uploaded": f"this rank's files uploaded to the cold tier {after} (the coordinator commits)",
            "none": "no cold tier",
        }.get(self.cold, f"not in the cold tier ({self.cold})")
        return (
            f"preempted ({heard}): saved step {self.step} ({self.checkpoint}) to the hot tier "
            f"{self.hot_seconds:.2f}s after the signal, {cold}; {self.seconds_left:.1f}s of the "
            f"{self.grace_seconds:g}s grace period left"
        )


class Preempting(Base):
    """Preemption of :class:`~tierstore.manager.CheckpointManager` (module docstring)."""

    def _watch_preemption(self, preemption: Preemption | bool) -> None:
        """Set up the watch (and its group) from ``CheckpointManager(preemption=)``."""
        self.preemption_options = preemption_options(preemption)
        self.preemption: PreemptionReport | None = None
        self._preempted = False
        self._grace_deadline: float | None = None  # time.monotonic(), once a request is seen
        self._watch: SignalWatch | None = None
        self._signal_group: Any = None
        if self.preemption_options is None:
            return
        self._watch = SignalWatch(self.preemption_options.signals)
        if self.distributed and dist.get_world_size() > 1:
            # Every rank builds the manager, so every rank joins the group (a collective).
            self._signal_group = dist.new_group(backend="gloo")

    @property
    def preempted(self) -> bool:
        """Whether a save acted on a preemption notice: the loop should stop (it is ``True``
        on every rank after the same ``save()`` call)."""
        return self._preempted

    def _preemption_seen(self) -> float | None:
        """Seconds since the earliest request on any rank; ``None`` if there is none. A
        collective when the manager watches and runs on more than one rank (module
        docstring, 2)."""
        watch = self._watch
        if watch is None or self._preempted:
            return None
        since = watch.seconds_since()
        if self._signal_group is not None:
            combined = torch.tensor([since], dtype=torch.float64)
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self._signal_group)
            since = float(combined.item())
        return None if since < 0 else since

    def _save_on_preemption(
        self, step: int, state: dict[str, Any], metrics: Mapping[str, float], since: float
    ) -> bool:
        """Save ``step`` now, to the hot tier and then, within the grace period, the cold
        tier; record and log what it managed (module docstring, 3)."""
        assert self.preemption_options is not None and self._watch is not None
        grace = self.preemption_options.grace_seconds
        signalled = time.monotonic() - since
        deadline = signalled + grace
        self._grace_deadline = deadline
        log.warning(
            "preemption notice (%s): saving step %d now, within the %gs grace period",
            self._watch.signal or "another rank's signal",
            step,
            grace,
        )
        try:
            self._finish_previous()
            self._raise_failure()
        except SaveFailed as err:  # that save is lost either way; this one is what matters now
            log.error("the save before the preemption notice failed (%s); saving step %d", err, step)
        self._preempted = True
        writer = self._writer(step, metrics)
        try:
            if step != self._last_saved_step:  # else saved already: push that one
                self._save_sync(step, state, writer)
        except SaveFailed as err:
            self.preemption = PreemptionReport(
                step, None, self._watch.signal, grace, time.monotonic() - signalled, "none", None,
                deadline - time.monotonic(), error=str(err),
            )  # fmt: skip
            log.error("%s", self.preemption.summary())
            raise
        hot_seconds = time.monotonic() - signalled
        self.stalls[step] = hot_seconds - since
        name = layout.default_name(step)  # the manager names each checkpoint by its step
        cold, cold_seconds = self._push_to_cold(name, _margin_before(deadline, grace))
        self.preemption = PreemptionReport(
            step, name, self._watch.signal, grace, hot_seconds, cold,
            None if cold_seconds is None else cold_seconds - signalled, deadline - time.monotonic(),
        )  # fmt: skip
        log.warning("%s", self.preemption.summary())
        return True

    def _push_to_cold(self, name: str | None, until: float) -> tuple[str, float | None]:
        """Wait for this process's migrations until ``until``; what became of ``name``'s."""
        from tierstore.tiers.delivery import await_delivery
        from tierstore.tiers.migrator import MigrationState

        if self.store.cold is None or name is None:
            return "none", None
        migrators = self._migrators()
        await_delivery(migrators, until)
        ended = time.monotonic()
        states = [s for m in migrators for s in m.status() if s.name == name]
        if not states:
            return "not handed to a migrator", ended
        status = states[-1]
        if status.state is MigrationState.COMMITTED:
            return "committed", ended
        if status.state is MigrationState.UPLOADED:
            return "uploaded", ended
        if status.state is MigrationState.FAILED:
            return f"failed: {status.error}", ended
        return f"still {status.state.value} at the grace deadline", ended

    def _close_deadline(self, deadline: float) -> float:
        """``close()``'s deadline: no later than the grace period's, less the exit margin."""
        if self._grace_deadline is None or self.preemption_options is None:
            return deadline
        return min(deadline, _margin_before(self._grace_deadline, self.preemption_options.grace_seconds))

    def _release_watch(self) -> None:
        if self._watch is not None:
            self._watch.release()
        if self._signal_group is not None:
            dist.destroy_process_group(self._signal_group)
            self._signal_group = None


def _margin_before(deadline: float, grace: float) -> float:
    return deadline - min(EXIT_MARGIN, grace / 10)
