"""The signal half of a preemption notice (:mod:`tierstore.manager.preemption`, 1 and 5):
handlers that only record the request, and the signal's own default action taken at the end."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["SignalWatch", "end_process"]

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalWatch:
    """Handlers for ``signals`` that record the first request (module docstring, 1).

    ``on_signal(number)`` is called from the handler on the first request: it may set an
    event, nothing that takes a lock the interrupted code may hold.
    """

    def __init__(self, signals: tuple[int, ...], *, on_signal: Callable[[int], None] | None = None) -> None:
        self.requested_at: float | None = None  # time.monotonic() of the first request
        self.signal: str | None = None  # its name
        self.number: int | None = None
        self._previous: dict[int, _Handler] = {}
        self._active = True
        self._on_signal = on_signal
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

    @property
    def active(self) -> bool:
        return self._active

    def previous(self, number: int) -> _Handler:
        """The handler this one passes ``number`` on to: the one installed before it, skipping
        every released watch's (managers opened and closed in any order: a released watch
        still in the chain passes the signal on, never takes its default action)."""
        handler = self._previous.get(number)
        seen: set[int] = set()
        while (
            isinstance(getattr(handler, "__self__", None), SignalWatch)
            and getattr(handler, "__func__", None) is SignalWatch._handle
            and id(handler.__self__) not in seen  # type: ignore[union-attr]
        ):
            watch: SignalWatch = handler.__self__  # type: ignore[union-attr]
            if watch.active:
                break
            seen.add(id(watch))
            handler = watch._previous.get(number)
        return handler

    def _handle(self, number: int, frame: FrameType | None) -> None:
        previous = self.previous(number)
        if not self._active:
            if previous in (signal.SIG_DFL, None):
                # Released, but called still (a handler installed after ours kept it): do
                # what the signal did before the manager, its default action.
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)
            elif callable(previous):
                previous(number, frame)
            return
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal, self.number = signal.Signals(number).name, number
            if self._on_signal is not None:
                self._on_signal(number)
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
                signal.signal(number, self.previous(number))


def end_process(number: int, why: str) -> None:
    """Take ``number``'s default action (end the process, as the signal would have without
    the manager), after flushing the logs and standard streams; ``os._exit`` if the signal
    does not end it (one whose default action is to be ignored)."""
    log.warning("%s: ending the process (%s's default action)", why, signal.Signals(number).name)
    for handler in logging.getLogger().handlers + logging.getLogger("tierstore").handlers:
        try:
            handler.flush()
        except Exception:  # a broken handler must not keep the process alive
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if threading.current_thread() is threading.main_thread():
        signal.signal(number, signal.SIG_DFL)
    else:  # the watchdog: Python sets handlers from the main thread only, the C library from any
        try:
            ctypes.CDLL(None).signal(number, ctypes.c_void_p(0))  # SIG_DFL
        except (OSError, AttributeError):
            os._exit(128 + number)
    os.kill(os.getpid(), number)
    time.sleep(1.0)  # delivered on return from the kill, at the latest here
    os._exit(128 + number)
