"""Statistics of repeated measurements: summaries, per-rank merges, per-rep ratios.

Every figure of the report is a median over reps (with its min and max), or a ratio of
two variants measured back to back in the same rep.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.infra.measure import Record


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": float(len(values)),
    }


def merge_ranks(
    records: Iterable[Record], keys: Sequence[str], slowest: Sequence[str], summed: Sequence[str]
) -> list[Record]:
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


def by_variant(records: Iterable[Record], field: str, key: str = "variant") -> dict[str, dict[str, float]]:
    """``{variant: summary of field over reps}`` for records that have the field."""
    values: dict[str, list[float]] = {}
    for record in records:
        value = record.get(field)
        if value is not None and not record.get("error"):
            values.setdefault(str(record[key]), []).append(float(value))
    return {name: summarize(vals) for name, vals in values.items()}


def paired_ratios(
    records: Iterable[Record], field: str, num: str, den: str, key: str = "variant"
) -> dict[str, float] | None:
    """Per-rep ratio ``num/den`` (measured back to back), summarized: a noise band."""
    per_rep: dict[Any, dict[str, float]] = {}
    for record in records:
        if record.get(field) is not None and not record.get("error"):
            per_rep.setdefault(record.get("rep"), {})[str(record[key])] = float(record[field])
    values = [rep[num] / rep[den] for rep in per_rep.values() if num in rep and rep.get(den)]
    return summarize(values) if values else None
