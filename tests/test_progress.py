"""tierstore.progress: what the display writes in plain mode, what it counts, and when it stays
quiet. The clock is injected: nothing here waits, but for the test of two threads reporting at
once."""

from __future__ import annotations

import io
import threading

from tierstore.progress import ProgressDisplay, counting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_at_the_interval_and_at_the_end_of_each_label() -> None:
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay(out, interval=10.0, clock=clock)
    first = counting("step-1", 3_000_000, display)
    first(1_000_000)  # started just now: no line yet
    clock.now += 11
    first(1_000_000)
    clock.now += 1
    first(-500_000)  # a retried file takes its bytes back
    first(1_500_000)
    counting("step-2", 1_000_000, display)(1_000_000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(":")[0] for line in lines] == ["step-1", "step-1", "step-2"]
    assert lines[0].startswith("step-1:  67% 2.00MB/3.00MB [00:11<")
    assert lines[1].startswith("step-1: 100% 3.00MB/3.00MB [00:12<00:00,")
    assert display.finished == ["step-1", "step-2"]
    assert (display.bytes_done, display.bytes_total) == (4_000_000, 4_000_000)


def test_hidden_display_counts_and_a_closed_one_ignores_late_reports() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, show=False)
    tick = counting("hot step-1", 2_000, display)
    tick(500)
    assert out.getvalue() == "" and display.bytes_done == 500 and display.finished == []
    display.close()
    tick(1_500)  # an upload thread still reporting while the command exits
    assert display.bytes_done == 500 and display.finished == []


def test_a_terminal_gets_a_bar_per_label() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, plain=False)
    counting("step-1", 2 << 20, display)(2 << 20)
    counting("step-2", 1 << 20, display)(1 << 10)
    display.close()
    text = out.getvalue()
    assert "\r" in text and "step-1: 100%|" in text and "step-2:   0%|" in text


def test_totals_reach_the_callback_in_the_order_they_were_reached() -> None:
    # Two upload threads of one checkpoint: the first adds its file's bytes and is about to
    # report when the second adds the rest. Reported after the second, the first's total
    # would take the count from 100% back down (a CI run's migrate showed 0, 2111044, 1524).
    seen: list[int] = []
    first_in, go_on = threading.Event(), threading.Event()

    def progress(label: str, done: int, total: int) -> None:
        if done == 1:
            first_in.set()
            assert go_on.wait(10)
        seen.append(done)

    tick = counting("step-1", 6, progress)
    first = threading.Thread(target=tick, args=(1,))
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=tick, args=(5,))
    second.start()
    second.join(0.3)  # time to report out of turn, were it let
    go_on.set()
    first.join(10)
    second.join(10)
    assert seen == [1, 6] and tick.done == 6
