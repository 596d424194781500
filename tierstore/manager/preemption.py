"""Preemption: a scheduler's notice (a signal, then a grace period before SIGKILL) turned into
one last checkpoint of the step the loop is at, in the hot tier and, within the grace period,
in the cold tier.

The protocol, on every rank:

1. **The handler only records.** :class:`SignalWatch` installs a handler for each of
   :class:`~tierstore.PreemptionOptions`'s signals that notes the first request's time and calls the
   handler that was there before it if that is a Python function. It does nothing else: a
   signal handler runs between two bytecodes of whatever the main thread was doing (holding
   the logging lock, or inside a collective), so it takes no lock and starts no I/O; it sets
   an event the watchdog (5) waits on. It does not end the process then: the step is saved
   first (3), and the process ends after (5). A closed manager's handler still in the chain
   is skipped (managers opened and closed in any order).
2. **Every ``save()`` combines the request across ranks**, the cadence's skipped steps
   included: one all-reduce (MAX) of "seconds since the signal, or -1" on a gloo group of the
   manager's own (DCP's async saves run collectives on the save group from a background
   thread; this one must never interleave with them). One rank's signal is so every rank's,
   at the same ``save()`` call, and every rank counts its deadline from the earliest signal.
3. **The save that sees it saves** that step whatever the cadence says: it waits for a save
   in flight (a failure of that one is logged, not raised: the new save is what matters now),
   saves synchronously so the hot commit is known when it returns, then waits for that
   checkpoint's migration (older pending ones are not waited for) up to the grace deadline
   less :data:`EXIT_MARGIN`, and no background prune starts (the next run prunes); it records what
   it managed in :attr:`CheckpointManager.preemption` (a :class:`PreemptionReport`, also logged at
   WARNING). ``save()`` returns ``True`` and ``preempted`` is ``True`` on every rank, so
   ``if manager.save(step, state) and manager.preempted: break`` stops every rank at one step.
4. **``close()`` keeps to the same deadline** and skips the final prune (the next run prunes);
   it releases the handlers, re-installing the ones that were there before. A signal that
   comes after the last save, or during ``close()``, bounds it by its grace period from then.
5. **The process ends**, as the signal would have ended it without the manager, unless the
   loop takes over by reading ``preempted`` once the notice's save returned (it stops, or
   goes on and keeps its retention once the grace period is over): a loop that never reads
   it has the run closed at its next ``save()`` or ``close()``, then the signal's default
   action (:func:`end_process`); a rank that never gets to another ``save()`` (stuck, or
   busy when torchrun's agent signals it) is ended by :class:`PreemptionWatch`'s watchdog
   half the exit margin before the grace deadline, unless the manager is still acting on
   the notice.

Off with ``CheckpointManager(preemption=False)``. A manager built outside the main thread
cannot install handlers (Python allows it only there): it says so at WARNING and saves as
if preemption were off.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tierstore import _dist
from tierstore.errors import ConfigError
from tierstore.manager.signals import SignalWatch, end_process
from tierstore.migration.delivery import deliver
from tierstore.migration.migrator import MigrationState, Migrator
from tierstore.options import PreemptionOptions

__all__ = [
    "PreemptionWatch",
    "PreemptionReport",
    "push_to_cold",
    "EXIT_MARGIN",
    "preemption_options",
]

log = logging.getLogger(__name__)

# Seconds of the grace period kept back for what follows the push to the cold tier: close(),
# the loop's own exit, interpreter shutdown. A tenth of the grace period, at most this.
EXIT_MARGIN = 3.0

_WATCHES: weakref.WeakSet[PreemptionWatch] = weakref.WeakSet()  # this process's live watches


def preemption_options(preemption: PreemptionOptions | bool) -> PreemptionOptions | None:
    """``CheckpointManager(preemption=)``: ``True`` is ``PreemptionOptions()``, ``False`` is off."""
    if preemption is True:
        return PreemptionOptions()
    if preemption is False:
        return None
    if isinstance(preemption, PreemptionOptions):
        return preemption
    raise ConfigError(
        "CheckpointManager(preemption=) takes True, False or a PreemptionOptions, "
        f"got {type(preemption).__name__}"
    )


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


class PreemptionWatch:
    """The watch and the combine across ranks (module docstring, 1 and 2), for whatever saves
    on a notice: :class:`~tierstore.manager.notice.NoticeHandler`, the part of the manager
    and of ``tierstore.integrations.torchtitan`` that acts on one.

    **The watchdog** (module docstring, 5): a daemon thread, woken by the handler's first
    request, that takes the signal's default action half the exit margin after :meth:`until`
    (the manager's own save, push and close on the notice are never cut short) unless the loop took
    over (:meth:`take_over`: it read ``preempted`` after a notice was acted on) or the watch
    was released: a rank that never gets to another ``save()`` (stuck in a collective with a
    peer that died, say) still ends before the scheduler's SIGKILL, as the signal would have
    ended it without the manager.
    """

    def __init__(self, options: PreemptionOptions) -> None:
        self.options = options
        self._signalled = threading.Event()  # set by the handler: nothing else touches it
        self._released = threading.Event()
        self.taken_over = False  # the loop read ``preempted`` after a notice: it decides now
        self.acting = False  # the manager is saving, pushing or closing on the notice
        self.signals = SignalWatch(options.signals, on_signal=lambda number: self._signalled.set())
        self.deadline: float | None = None  # time.monotonic() of the grace period's end, once seen
        self._group: Any = None
        _WATCHES.add(self)
        self._raw: tuple[float, int] | None = None  # (when, number): a signal heard through the pipe
        self._wake: tuple[int, int] | None = None  # the wakeup pipe: read end, write end
        if self.signals.installed:
            self._wake_on_signal()
            threading.Thread(target=self._watchdog, name="tierstore-preemption-watchdog", daemon=True).start()
        if _dist.initialized() and dist.get_world_size() > 1:
            # Every rank builds its watch with the manager, so every rank joins (a collective).
            self._group = dist.new_group(backend="gloo")

    @property
    def signal(self) -> str | None:
        """The signal this rank got (``None``: none, or another rank's was heard)."""
        return self.signals.signal

    def seen(self) -> float | None:
        """Seconds since the earliest request on any rank, ``None`` if there is none; sets
        :attr:`deadline` the first time. A collective on more than one rank."""
        since = self.signals.seconds_since()
        if self._group is not None:
            combined = torch.tensor([since], dtype=torch.float64)
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self._group)
            since = float(combined.item())
        if since < 0:
            return None
        if self.deadline is None:
            self.deadline = time.monotonic() - since + self.options.grace_seconds
        return since

    def grace_deadline(self) -> float | None:
        """The end of the grace period: of the notice combined across ranks, else of this
        rank's own signal (one that came after the last ``save()``); ``None`` without one."""
        if self.deadline is not None:
            return self.deadline
        if self.signals.requested_at is not None:
            return self.signals.requested_at + self.options.grace_seconds
        return None

    def margin(self) -> float:
        """Seconds kept back from the grace period for what follows the push."""
        return min(EXIT_MARGIN, self.options.grace_seconds / 10)

    def until(self) -> float:
        """When what follows the push must begin: the deadline less the exit margin."""
        deadline = self.grace_deadline()
        assert deadline is not None, "no notice seen"
        return deadline - self.margin()

    def in_grace(self) -> bool:
        """Whether a notice came (here or on any rank) and its grace period bounds every wait:
        the process is to end by then. Only a loop that took over and went on past the end
        of the period is out of it (the notice was not the end, after all)."""
        deadline = self.grace_deadline()
        if deadline is None:
            return False
        return not self._loop_took_over() or time.monotonic() < deadline

    def take_over(self) -> None:
        """The loop read ``preempted`` after a notice was acted on: it ends the run itself
        (and may go on); the watchdog and the manager's own end of the process stand down."""
        self.taken_over = True

    def _loop_took_over(self) -> bool:
        """This watch's loop, or another live watch's in this process, took over."""
        return self.taken_over or any(w.taken_over for w in list(_WATCHES) if not w._released.is_set())

    def _wake_on_signal(self) -> None:
        """Have the C library's handler write each signal's number to a pipe the watchdog
        reads (``signal.set_wakeup_fd``), unless something else (an asyncio loop) has the
        wakeup already: a main thread blocked in C (a collective with a peer that died)
        never runs the Python handler, and the watchdog must hear the signal all the same."""
        try:
            read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            before = -2
        if before != -1:  # taken by someone else (or none could be set): theirs stays
            if before >= 0:
                signal.set_wakeup_fd(before)
            os.close(read)
            os.close(write)
            return
        self._wake = (read, write)

    def _heard(self, wait: float) -> bool:
        """Whether one of the watched signals came (the handler ran, or the C library wrote
        its number to the wakeup pipe), waiting at most ``wait`` seconds."""
        if self._signalled.is_set():
            return True
        wake = self._wake  # release() may drop it meanwhile: this thread keeps its own copy
        if wake is None:
            return self._signalled.wait(wait)
        try:
            ready, _, _ = select.select([wake[0]], [], [], wait)
            data = os.read(wake[0], 512) if ready else b""
        except (OSError, ValueError):  # released and closed meanwhile
            return self._signalled.is_set()
        for number in data:
            if number in self.options.signals and self._raw is None:
                self._raw = (time.monotonic(), number)
        return self._raw is not None or self._signalled.is_set()

    def _watchdog(self) -> None:
        while not self._heard(1.0):
            if self._released.is_set():
                return
        while not self._released.is_set() and not self._loop_took_over():
            # Half the exit margin after the push's and close()'s own deadline: the manager
            # acting on the notice (its save, its push, close()) is never cut short by it.
            deadline = self.grace_deadline()
            if deadline is None:  # heard through the pipe only: the main thread is blocked
                assert self._raw is not None
                deadline = self._raw[0] + self.options.grace_seconds
            now = time.monotonic()
            left = deadline - self.margin() / 2 - now
            if left <= 0 and self.acting and now < deadline:
                left = min(0.05, deadline - now)  # the manager's own close: to the very end
            elif left <= 0:
                number = self.signals.number or (self._raw[1] if self._raw else self.options.signals[0])
                end_process(
                    number,
                    f"preemption notice ({signal.Signals(number).name}): the grace period is ending "
                    "and the loop neither stopped on `manager.preempted` nor reached another save()",
                )
            self._released.wait(min(left, 1.0))

    def release(self) -> None:
        self._released.set()
        self.signals.release()
        if self._wake is not None and threading.current_thread() is threading.main_thread():
            current = signal.set_wakeup_fd(-1)
            if current != self._wake[1]:  # someone set theirs since: it stays
                signal.set_wakeup_fd(current)
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def push_to_cold(migrators: Sequence[Migrator], step: int, until: float) -> tuple[str, float | None]:
    """Spend until ``until`` (a ``time.monotonic()`` value) getting ``step``'s checkpoint
    migrated by ``migrators``: committed or, for a rank other than the coordinator (which
    commits), uploaded. A migration that fails for a reason another try may cure is tried
    again each time the cold tier answers, until then (docs/design.md invariant 26): a cold
    tier that refused once and came back within the grace period still gets the notice's
    checkpoint. Older pending migrations are not waited for: the notice's checkpoint is the
    one the relaunch resumes. What became of it, and when the wait ended."""
    if not migrators:
        return "none", None
    names = {s.name for m in migrators for s in m.status() if s.step == step}
    if names:
        deliver(migrators, migrators[0].cold, until, names=names, give_up_after=None)
    ended = time.monotonic()
    states = [s for m in migrators for s in m.status() if s.step == step]
    status = states[-1] if states else None
    if status is None:
        return "not handed to a migrator", ended
    if any(m.delivered(status.name, status.attempt) for m in migrators):
        return "committed", ended
    if status.state is MigrationState.COMMITTED:
        return "committed", ended
    if status.state is MigrationState.UPLOADED:
        return "uploaded", ended
    if status.state is MigrationState.FAILED:
        return f"failed: {status.error}", ended
    return f"still {status.state.value} at the grace deadline", ended
