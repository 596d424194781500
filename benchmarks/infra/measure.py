"""Measuring inside a job: units, timers, CPU seconds and peak-RSS growth."""

from __future__ import annotations

import ctypes
import gc
import resource
import time
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

Record = dict[str, Any]


def now() -> float:
    return time.perf_counter()


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread included.

    Far steadier than wall time on a shared VM (no steal, no disk cache luck): where the
    disk is not the bottleneck, CPU time per byte is what limits throughput.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_status(field: str) -> int | None:
    """A ``/proc/self/status`` value in bytes (``VmRSS:``, ``VmHWM:``), ``None`` off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``).

    Without it, buffers freed by an earlier measurement stay resident and a later one
    reuses them without growing the RSS: its peak would look smaller than it is.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; return that RSS."""
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    return proc_status("VmRSS:")


def peak_growth(before: int | None) -> int | None:
    """How far the peak RSS rose above ``before`` (from :func:`reset_peak_rss`)."""
    peak = proc_status("VmHWM:")
    return None if before is None or peak is None else max(0, peak - before)
