from __future__ import annotations

import pytest

from tierstore.errors import StorageError, TransientStorageError
from tierstore.retry import RetryPolicy, polling


def flaky(failures: int, exc: type[Exception] = TransientStorageError):
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise exc("SlowDown 503", key="k", tier="cold s3://b")
        return "done"

    return fn, calls


def test_transient_errors_are_retried_with_backoff() -> None:
    sleeps: list[float] = []
    fn, calls = flaky(3)
    assert RetryPolicy(attempts=5, initial=0.1, maximum=1.0).call(fn, sleep=sleeps.append) == "done"
    assert len(calls) == 4 and len(sleeps) == 3
    assert all(0 <= s <= 1.0 for s in sleeps)


def test_gives_up_after_attempts_with_the_last_error() -> None:
    fn, calls = flaky(10)
    with pytest.raises(TransientStorageError):
        RetryPolicy(attempts=3).call(fn, sleep=lambda s: None)
    assert len(calls) == 3


def test_permanent_errors_are_not_retried() -> None:
    fn, calls = flaky(1, StorageError)
    with pytest.raises(StorageError):
        RetryPolicy(attempts=5).call(fn, sleep=lambda s: None)
    assert len(calls) == 1


def test_deadline_bounds_total_time() -> None:
    fn, calls = flaky(100)
    with pytest.raises(TransientStorageError):
        RetryPolicy(attempts=1000, deadline=0.0).call(fn, sleep=lambda s: None)
    assert len(calls) == 1


class FakeTime:
    """A clock that only moves when something sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def test_deadline_is_measured_on_the_injected_clock() -> None:
    time = FakeTime()
    fn, calls = flaky(100)
    with pytest.raises(TransientStorageError):
        RetryPolicy(attempts=None, deadline=10.0, initial=1.0, maximum=1.0).call(
            fn, sleep=time.sleep, clock=time.clock
        )
    assert time.now >= 10.0 and len(calls) == len(time.slept) + 1
    assert time.now - time.slept[-1] < 10.0  # it stopped at the first try past the deadline


def test_poll_returns_the_first_wanted_answer_with_growing_waits() -> None:
    time = FakeTime()
    answers = iter([3, 2, 1, 0, -1])
    result = polling(0.5, 60.0, maximum=3.0).poll(
        lambda: next(answers), until=lambda n: n == 0, sleep=time.sleep, clock=time.clock
    )
    assert result == 0
    assert time.slept == [0.5, 1.0, 2.0]  # doubling, no jitter; never past maximum


def test_poll_at_a_fixed_interval_gives_the_last_answer_at_the_deadline() -> None:
    time = FakeTime()
    probes: list[float] = []

    def probe() -> str:
        probes.append(time.now)
        return "busy"

    assert (
        polling(2.0, 7.0).poll(probe, until=lambda a: a == "idle", sleep=time.sleep, clock=time.clock)
        == "busy"
    )
    assert probes == [0.0, 2.0, 4.0, 6.0, 8.0] and set(time.slept) == {2.0}


def test_poll_waits_never_below_the_interval() -> None:
    time = FakeTime()
    answers = iter([False, False, True])
    polling(5.0, None, maximum=1.0).poll(lambda: next(answers), until=bool, sleep=time.sleep)
    assert time.slept == [5.0, 5.0]


def test_poll_lets_a_probe_error_through_at_once() -> None:
    time = FakeTime()
    fn, calls = flaky(1)  # transient, yet a poll does not retry failures
    with pytest.raises(TransientStorageError):
        polling(1.0, 60.0).poll(fn, until=lambda a: a == "done", sleep=time.sleep, clock=time.clock)
    assert len(calls) == 1 and time.slept == []
