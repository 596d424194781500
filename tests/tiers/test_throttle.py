"""The migration bandwidth cap (tierstore.migration.transfer.Throttle), on an injected clock."""

from __future__ import annotations

import pytest

from tierstore.migration.transfer import Throttle


def test_throttle_caps_bytes_per_second() -> None:
    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    throttle = Throttle(1000.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(10):
        throttle.consume(500)
    assert now[0] == pytest.approx(5.0)  # 5000 bytes at 1000 B/s, every chunk paid
    assert slept and all(s > 0 for s in slept)  # it waited, never a negative sleep
