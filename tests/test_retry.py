from __future__ import annotations

import pytest

from tierstore.errors import StorageError, TransientStorageError
from tierstore.retry import RetryPolicy


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
