"""Measuring inside a job: units, timers, CPU seconds and peak-RSS growth."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

Record = dict[str, Any]


def now() -> float:
    return time.perf_counter()


def await_async_save(answer: Any, start: float) -> tuple[float, float, float]:
    """``(stall, staged, done)`` seconds since ``start`` for what ``dcp.async_save`` returned
    at the moment of this call: a bare future (staged once returned) or an
    ``AsyncSaveResponse`` (staging and upload futures)."""
    stall = now() - start
    staging = getattr(answer, "staging_completion", None)
    if staging is None:
        answer.result()
        return stall, stall, now() - start
    staging.result()
    staged = now() - start
    answer.upload_completion.result()
    return stall, staged, now() - start


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread included.

    Far steadier than wall time on a shared VM (no steal, no disk cache luck): where the
    disk is not the bottleneck, CPU time per byte is what limits throughput.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_seconds() -> float:
    """CPU time of this process, of its children already reaped, and of its live
    descendants (read from ``/proc``): for peers that write from a helper process of their
    own (DCP's PROCESS mode, torch_checkpointing's writer), whose CPU getrusage of this
    process alone would miss."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _descendants(os.getpid()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile: counted in RUSAGE_CHILDREN once reaped
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found


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
