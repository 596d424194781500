"""Asking a cold tier whether it answers: one listing, bounded in time.

A backend's own retries and timeouts (minutes, for S3) suit an upload that may succeed, not
a question asked at a prompt, at the end of a run, or by the migrator's breaker deciding
whether to let a job through (:mod:`tierstore.migration.migrator`). :func:`unreachable` asks
once, on a daemon thread it leaves behind if no answer comes in time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tierstore.errors import StorageError, TierstoreError
from tierstore.format import layout
from tierstore.tiers.tier import Tier

__all__ = ["unreachable", "PROBE_WAIT"]

PROBE_WAIT = 10.0  # seconds the end of a run gives the cold tier to answer one listing
_PROBE_THREAD = "tierstore-cold-probe"


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


def unreachable(cold: Tier, wait: float, *, give_up: Callable[[], bool] | None = None) -> str | None:
    """Why ``cold`` cannot be listed within ``wait`` seconds; ``None`` if it can.

    The listing runs on a daemon thread, left behind if it has not returned by then: a
    backend's own retries and timeouts (minutes, for S3) suit an upload that may succeed,
    not a question asked at a prompt or at the end of a run. ``give_up()``, asked every
    0.1 s, ends the wait sooner (a deadline that moved closer). Errors other than storage
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
    ends = time.monotonic() + wait
    while thread.is_alive() and time.monotonic() < ends and not (give_up is not None and give_up()):
        thread.join(min(0.1, max(0.0, ends - time.monotonic())))
    error = box.get("error")
    if isinstance(error, StorageError):
        return f"{type(error).__name__}: {error.message}"
    if isinstance(error, BaseException):
        raise error
    if box.get("ok"):
        return None
    last = _PROBE_RETRIES.last
    return f"no answer within {wait:g} s" + (f"; last error: {last}" if last else "")
