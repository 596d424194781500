"""Progress of a long operation (migrate, restore, verify), shown with tqdm.

The library reports progress through one callback shape, ``progress(label, bytes_done,
bytes_total)``, where a label is one file group: a checkpoint being migrated or restored,
or one tier's copy of a checkpoint being verified. :func:`counting` turns a stream of byte
counts into those calls. :class:`ProgressDisplay` is the one consumer, for the command
line: a tqdm bar per label on a terminal (bytes, throughput, ETA), plain lines without
carriage returns when the stream is a file or a pipe (a log must not fill with redraws),
or nothing at all, while still counting what was done for the line an interrupted command
prints.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["ByteCount", "ProgressCallback", "ProgressDisplay", "counting", "size_text"]

ProgressCallback = Callable[[str, int, int], None]

# SI units (MB = 10**6 B): tqdm scales the counts and the rate alike, and names no "iB".
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"
_PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"
_UNITS: dict[str, Any] = {"unit": "B", "unit_scale": True, "unit_divisor": 1000}


class ByteCount:
    """A ``(n_bytes)`` callback that adds up what a copy or a read reports and passes the
    running total of ``label`` to ``progress``; a negative count takes bytes back (a
    retried file starts over). ``done`` is the running total.

    Uploads report from several threads. ``progress`` is called under the counter's lock,
    so the totals reach it in the order they were reached: a total computed on one thread
    and reported after a later one from another would show the count going back (a bar at
    100% dropping to the size of the first file)."""

    def __init__(self, label: str, total: int, progress: ProgressCallback | None) -> None:
        self.label, self.total, self.progress = label, total, progress
        self.done = 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.progress is not None:
                self.progress(self.label, self.done, self.total)


def counting(label: str, total: int, progress: ProgressCallback | None) -> ByteCount:
    """The one byte counter behind every ``progress(label, done, total)`` report."""
    return ByteCount(label, total, progress)


class ProgressDisplay:
    """A :data:`ProgressCallback` that shows each label's bytes, rate and ETA on ``stream``.

    ``show=False`` displays nothing and only counts. ``plain`` (default: ``stream`` is not
    a terminal) writes a line when a label finishes and at most every ``interval`` seconds
    while it runs. Safe to call from several threads; calls after :meth:`close` are ignored
    (upload threads may still report while an interrupted command is exiting).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        show: bool = True,
        plain: bool | None = None,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.show = show
        self.plain = plain
        self.interval = interval
        self.clock = clock
        self.finished: list[str] = []
        self.bytes_done = 0
        self._totals: dict[str, tuple[int, int]] = {}
        self._bar: tqdm[Any] | None = None
        self._label: str | None = None
        self._started = 0.0
        self._last_line = 0.0
        self._closed = False
        self._lock = threading.RLock()  # re-entered when Ctrl-C lands inside a call

    def __call__(self, label: str, done: int, total: int) -> None:
        with self._lock:
            if self._closed:
                return
            if label != self._label:
                self._switch(label, total)
            previous = self._totals.get(label, (0, total))[0]
            self._totals[label] = (done, total)
            self.bytes_done += done - previous
            complete = done >= total
            if complete and label not in self.finished:
                self.finished.append(label)
            if self.show:
                self._draw(label, done, total, complete)

    @property
    def labels(self) -> list[str]:
        """Every label seen so far, in the order first seen."""
        return list(self._totals)

    @property
    def bytes_total(self) -> int:
        """The bytes of every label seen so far."""
        return sum(total for _, total in self._totals.values())

    def close(self) -> None:
        """End the current bar; later calls are ignored."""
        with self._lock:
            self._closed = True
            self._end_bar()

    def _switch(self, label: str, total: int) -> None:
        self._end_bar()
        self._label = label
        self._started = self._last_line = self.clock()
        if self.show and not self._is_plain():
            self._bar = tqdm(
                total=total,
                desc=label,
                file=self.stream,
                bar_format=_FORMAT,
                dynamic_ncols=True,
                leave=True,
                **_UNITS,
            )

    def _draw(self, label: str, done: int, total: int, complete: bool) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            if complete:
                self._end_bar()
            return
        now = self.clock()
        if complete or now - self._last_line >= self.interval:
            self._last_line = now
            line = tqdm.format_meter(
                done, total, now - self._started, prefix=label, bar_format=_PLAIN_FORMAT, **_UNITS
            )
            self._write(line + "\n")

    def _end_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _is_plain(self) -> bool:
        if self.plain is None:
            isatty = getattr(self._out(), "isatty", None)
            self.plain = not (callable(isatty) and isatty())
        return self.plain

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _write(self, text: str) -> None:
        out = self._out()
        out.write(text)
        out.flush()


def size_text(n: float) -> str:
    """``n`` bytes as the progress lines write them (``12.0MB``)."""
    return str(tqdm.format_sizeof(n, suffix="B", divisor=1000))
