"""Background rounds: one piece of upkeep (pruning, resuming migrations) at a time, on a
daemon thread, however often it is asked for.

A request while a round runs folds into one more round after it, so a slow or stalled cold
tier never queues a round per save, and a process that exits never waits on one (the
thread is a daemon). ``CheckpointManager`` prunes and resumes pending migrations this way
after each commit; the torchtitan drop-in prunes its hot tier this way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["BackgroundRounds"]

log = logging.getLogger(__name__)


class BackgroundRounds:
    """Runs ``work(full)`` in rounds on a daemon thread named ``name``.

    :meth:`request` starts a round if none runs, else asks for one more after it (a full
    one if any request since asked for ``full``); either way it returns the future that
    completes once no round is left. An exception of ``work`` goes to ``on_error`` (logged
    by default), and the rounds go on.
    """

    def __init__(
        self, work: Callable[[bool], None], *, name: str, on_error: Callable[[Exception], None] | None = None
    ) -> None:
        self._work, self._name = work, name
        self._on_error = on_error or (lambda err: log.error("%s failed: %s", name, err))
        self._lock = threading.Lock()
        self._running: Future[None] | None = None
        self._again: bool | None = None  # another round wanted (True: a full one)

    def request(self, full: bool = True) -> Future[None]:
        with self._lock:
            if self._running is not None and not self._running.done():
                self._again = bool(self._again) or full
                return self._running
            future: Future[None] = Future()
            self._running, self._again = future, None

        def rounds() -> None:
            current = full
            while True:
                try:
                    self._work(current)
                except Exception as err:
                    self._on_error(err)
                with self._lock:
                    if self._again is None:
                        future.set_result(None)
                        return
                    current, self._again = self._again, None

        threading.Thread(target=rounds, name=self._name, daemon=True).start()
        return future

    def running(self) -> Future[None] | None:
        """The future of the rounds running now, ``None`` if none runs."""
        with self._lock:
            running = self._running
        return running if running is not None and not running.done() else None
