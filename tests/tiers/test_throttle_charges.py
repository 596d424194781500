"""`--bandwidth` charges every chunk, the last one too (issue 34, item 4): n bytes at r bytes
per second take n / r seconds, whatever the chunk size. Before, each chunk's time was
charged to the next one, so the last chunk was free: a 6 MiB file (one 8 MiB chunk) at
1 MiB/s went through in 0.3 s. Exact on an injected clock; then real commands, small."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import saved

from tierstore.migration.transfer import Throttle, copy_file
from tierstore.tiers.tier import Tier

MIB = 2**20


class Clock:
    """Time that moves only when slept through (or advanced by the test)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0, seconds  # never a zero or negative sleep
        self.slept.append(seconds)
        self.now += seconds


def test_one_chunk_is_paid_in_full() -> None:
    clock = Clock()
    throttle = Throttle(1 * MIB, clock=clock, sleep=clock.sleep)
    with throttle.sending(6 * MIB):
        pass
    assert clock.now == 6.0


def test_every_chunk_is_paid_the_last_one_too() -> None:
    clock = Clock()
    throttle = Throttle(1000.0, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        throttle.consume(500)
    assert clock.now == pytest.approx(5.0)


def test_the_time_a_send_takes_counts_toward_its_own_slot() -> None:
    clock = Clock()
    throttle = Throttle(1000.0, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        with throttle.sending(1000):
            clock.now += 0.25  # the write itself
    assert clock.now == pytest.approx(4.0)  # the cap, not the cap plus the writes
    assert clock.slept == pytest.approx([0.75] * 4)
    with throttle.sending(1000):
        clock.now += 3.0  # slower than the cap: no sleep at all
    assert clock.slept == pytest.approx([0.75] * 4)


def test_idle_time_earns_no_burst() -> None:
    clock = Clock()
    throttle = Throttle(1000.0, clock=clock, sleep=clock.sleep)
    clock.now = 100.0  # nothing sent for 100 s
    with throttle.sending(2000):
        pass
    assert clock.now == pytest.approx(102.0)


def test_no_rate_never_sleeps() -> None:
    clock = Clock()
    for rate in (None, 0):
        with Throttle(rate, clock=clock, sleep=clock.sleep).sending(10 * MIB):
            pass
    assert clock.now == 0.0 and not clock.slept


def test_threads_that_share_it_share_the_cap() -> None:
    throttle = Throttle(400_000.0)  # real time: 4 threads x 5 x 20 kB = 400 kB, at least 1 s
    started = time.monotonic()

    def send() -> None:
        for _ in range(5):
            with throttle.sending(20_000):
                pass

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.99


def test_copy_file_pays_for_a_file_of_one_chunk(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    manifest = saved(hot, 1, shape=(512, 512))  # 1 MiB of float32
    entry = max(manifest.files, key=lambda f: f.size)
    clock = Clock()
    copy_file(
        Tier("hot", hot),
        Tier("cold", str(tmp_path / "cold")),
        manifest.name,
        manifest.attempt,
        entry,
        chunk_size=8 * MIB,  # the whole file in one chunk
        throttle=Throttle(entry.size / 2.0, clock=clock, sleep=clock.sleep),
    )
    assert clock.now == pytest.approx(2.0)


def cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    return proc, time.monotonic() - started


@pytest.mark.parametrize("command", ["cp", "restore"])
def test_the_commands_take_as_long_as_the_bandwidth_says(tmp_path: Path, command: str) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = saved(hot, 1, shape=(512, 768))  # 1.5 MiB, one chunk of the copy
    seconds = manifest.total_size / MIB  # at 1 MiB/s
    if command == "cp":
        # One file at a time: .metadata, then the data file, the last chunk (it went free).
        proc, took = cli(
            "cp", "--hot", hot, "--step", "1", "--to", cold, "--bandwidth", "1", "--concurrency", "1"
        )
    else:
        assert cli("migrate", "--hot", hot, "--cold", cold)[0].returncode == 0
        proc, took = cli("restore", "--hot", str(tmp_path / "again"), "--cold", cold, "--bandwidth", "1")
    assert proc.returncode == 0, proc.stderr
    assert took >= seconds, (took, seconds)  # before: ~0.3 s, the whole file free
