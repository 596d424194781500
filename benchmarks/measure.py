"""Timing, statistics and peak-RSS helpers shared by the benchmarks."""

from __future__ import annotations

import ctypes
import gc
import resource
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
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


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": float(len(values))}


def merge_ranks(records: Iterable[Record], keys: Sequence[str], slowest: Sequence[str],
                summed: Sequence[str]) -> list[Record]:
    """Merge per-rank records of one measurement (same values for ``keys``).

    A training step waits for its slowest rank, so times and peak memory take the max over
    ranks (``slowest``); bytes and CPU seconds add up (``summed``).
    """
    merged: dict[tuple[Any, ...], Record] = {}
    for record in records:
        ident = tuple(record.get(k) for k in keys)
        into = merged.setdefault(ident, {k: record.get(k) for k in keys})
        for name in (*slowest, *summed):
            value = record.get(name)
            if value is None:
                continue
            previous = into.get(name)
            if previous is None:
                into[name] = value
            else:
                into[name] = previous + value if name in summed else max(previous, value)
        if record.get("error"):
            into["error"] = record["error"]
    return list(merged.values())


def by_variant(records: Iterable[Record], field: str, key: str = "variant"
               ) -> dict[str, dict[str, float]]:
    """``{variant: summary of field over reps}`` for records that have the field."""
    values: dict[str, list[float]] = {}
    for record in records:
        value = record.get(field)
        if value is not None and not record.get("error"):
            values.setdefault(str(record[key]), []).append(float(value))
    return {name: summarize(vals) for name, vals in values.items()}


def ratio(summaries: Mapping[str, Mapping[str, float]], num: str, den: str) -> float | None:
    """Ratio of two variants' medians, ``None`` if either is missing."""
    if num not in summaries or den not in summaries or not summaries[den]["median"]:
        return None
    return summaries[num]["median"] / summaries[den]["median"]


def paired_ratios(records: Iterable[Record], field: str, num: str, den: str,
                  key: str = "variant") -> dict[str, float] | None:
    """Per-rep ratio ``num/den`` (measured back to back), summarized: a noise band."""
    per_rep: dict[Any, dict[str, float]] = {}
    for record in records:
        if record.get(field) is not None and not record.get("error"):
            per_rep.setdefault(record.get("rep"), {})[str(record[key])] = float(record[field])
    values = [rep[num] / rep[den] for rep in per_rep.values() if num in rep and rep.get(den)]
    return summarize(values) if values else None
