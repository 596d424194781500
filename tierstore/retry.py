"""The one place retry policy lives.

Only errors classified transient (:class:`~tierstore.errors.TransientStorageError`, which
backends raise for throttling, dropped connections and 5xx answers) are retried, with
jittered exponential backoff bounded by attempts and total time. Retry whole idempotent
units (one object upload, one part, one publish read-back), never a half-read stream.

Waiting for a state the tiers do not hold yet (another rank's upload mark, a migration to
commit) is the same policy asked a different question: :meth:`RetryPolicy.poll` calls a probe
until its answer is the one wanted, with :func:`polling` for the usual shape. ``sleep`` and
``clock`` are injectable so tests never wait on a real backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, retry_if_result
from tenacity.wait import wait_base, wait_exponential, wait_random_exponential

from tierstore.errors import TransientStorageError

__all__ = ["RetryPolicy", "DEFAULT", "NO_RETRY", "is_transient", "polling"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TransientStorageError)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: up to ``attempts`` tries within ``deadline`` seconds (``None``:
    unbounded), waiting ``initial`` seconds, then ``growth`` times longer each time, never
    more than ``maximum``. With ``jitter`` each wait is drawn at random below that bound, so
    many clients backing off from one throttled store spread apart."""

    attempts: int | None = 8
    deadline: float | None = 300.0
    initial: float = 0.25
    maximum: float = 20.0
    growth: float = 2.0
    jitter: bool = True

    def call(
        self,
        fn: Callable[[], T],
        *,
        what: str = "operation",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """Run ``fn``, retrying transient failures; the last error propagates."""

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s failed (attempt %d of %s), retrying in %.2fs: %s",
                what,
                state.attempt_number,
                self.attempts,
                state.next_action.sleep if state.next_action else 0.0,
                exc,
            )

        retrying: Retrying = Retrying(
            stop=self._stop(clock),
            wait=self._wait(),
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

    def poll(
        self,
        probe: Callable[[], T],
        *,
        until: Callable[[T], bool],
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """Call ``probe`` until ``until(answer)`` holds, waiting between calls as the policy
        says; return the last answer, also when attempts or the deadline ran out first (the
        caller tells the two apart with ``until``). An error ``probe`` raises propagates at
        once: a poll repeats a question, not a failure."""

        def last_answer(state: RetryCallState) -> T:
            assert state.outcome is not None  # tenacity stops only after an attempt
            return state.outcome.result()  # type: ignore[no-any-return]

        retrying: Retrying = Retrying(
            stop=self._stop(clock),
            wait=self._wait(),
            retry=retry_if_result(lambda a: not until(a)),
            sleep=sleep,
            reraise=True,
            retry_error_callback=last_answer,
        )
        return retrying(probe)

    def _stop(self, clock: Callable[[], float]) -> Callable[[RetryCallState], bool]:
        # Our own clock rather than tenacity's stop_after_delay, so tests can move time.
        start = clock()

        def stop(state: RetryCallState) -> bool:
            if self.attempts is not None and state.attempt_number >= self.attempts:
                return True
            return self.deadline is not None and clock() - start >= self.deadline

        return stop

    def _wait(self) -> wait_base:
        kind = wait_random_exponential if self.jitter else wait_exponential
        return kind(multiplier=self.initial, max=self.maximum, exp_base=self.growth)


def polling(interval: float, timeout: float | None = None, *, maximum: float | None = None) -> RetryPolicy:
    """Poll every ``interval`` seconds until ``timeout`` (``None``: for ever); with
    ``maximum``, the interval doubles after each poll up to ``maximum`` (never below
    ``interval``). No jitter: a poll is one reader, not a crowd."""
    ceiling = interval if maximum is None else max(interval, maximum)
    return RetryPolicy(
        attempts=None,
        deadline=timeout,
        initial=interval,
        maximum=ceiling,
        growth=1.0 if maximum is None else 2.0,
        jitter=False,
    )


DEFAULT = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)
