"""The one place retry policy lives.

Only errors classified transient (:class:`~tierstore.errors.TransientStorageError`, which
backends raise for throttling, dropped connections and 5xx answers) are retried, with
jittered exponential backoff bounded by attempts and total time. Retry whole idempotent
units (one object upload, one part, one publish read-back), never a half-read stream.
``sleep`` is injectable so tests never wait on a real backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from tierstore.errors import TransientStorageError

__all__ = ["RetryPolicy", "DEFAULT", "NO_RETRY", "is_transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TransientStorageError)


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff: ``attempts`` tries within ``deadline`` seconds."""

    attempts: int = 8
    deadline: float = 300.0
    initial: float = 0.25
    maximum: float = 20.0

    def call(self, fn: Callable[[], T], *, what: str = "operation",
             sleep: Callable[[float], None] = time.sleep) -> T:
        """Run ``fn``, retrying transient failures; the last error propagates."""

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s failed (attempt %d of %d), retrying in %.2fs: %s", what,
                        state.attempt_number, self.attempts,
                        state.next_action.sleep if state.next_action else 0.0, exc)

        retrying: Retrying = Retrying(
            stop=stop_after_attempt(self.attempts) | stop_after_delay(self.deadline),
            wait=wait_random_exponential(multiplier=self.initial, max=self.maximum),
            retry=retry_if_exception(is_transient),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        # Hand the result back beside tenacity, not through it: its retry state is a
        # reference cycle, and a large block returned through it would stay alive until
        # the next garbage collection (doubling a streaming reader's memory).
        box: list[T] = []
        retrying(lambda: box.append(fn()))
        return box.pop()


DEFAULT = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)
