"""The report's Preemption section: saving on a preemption notice (``benchmarks/jobs/preemption.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import Lines, size_label, table
from benchmarks.report.template import paragraph

COLDS = {"local": "a local directory", "s3": "S3 (moto)"}


def _values(records: list[dict[str, Any]], variant: str, field: str) -> list[float]:
    return [r[field] for r in records if r["variant"] == variant and r.get(field) is not None]


def _cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    best, worst = min(values), max(values)
    return f"{best:.3f} (spread {worst / best:.2f}x)" if best > 0 else f"{best:.3f}"


def preemption_section(results: Mapping[str, Any], img: Path | None = None) -> Lines:
    suite = results["suites"].get("preemption")
    if not suite:
        return []
    records = suite["records"]
    rows = []
    for cold, text in COLDS.items():
        sync = _values(records, f"sync@{cold}", "commit")
        for kind, what in (("notice", "between saves"), ("notice_in_flight", "an async save in flight")):
            variant = f"{kind}@{cold}"
            hot = _values(records, variant, "commit")
            lefts = [r["left"] / r["grace"] for r in records if r["variant"] == variant and "left" in r]
            states = sorted({str(r.get("cold_state")) for r in records if r["variant"] == variant})
            ratio = A.div(min(hot, default=None), min(sync, default=None))
            rows.append(
                [
                    f"{text}, {what}",
                    _cell(sync),
                    _cell(hot),
                    "n/a" if ratio is None else f"{ratio:.2f}x",
                    _cell(_values(records, variant, "cold")),
                    "n/a" if not lefts else f"{100 * min(lefts):.0f}%",
                    ", ".join(states) or "-",
                ]
            )
    return paragraph(
        "preemption",
        started=results.get("started", ""),
        size=size_label(suite["bytes"]),
        reps=suite["reps"],
        grace=f"{suite['grace']:g}",
        table=table(
            [
                "cold tier, signal",
                "sync dcp.save to hot commit, s",
                "signal to hot commit, s",
                "ratio (best/best)",
                "signal to end of the cold push, s",
                "grace period left (least)",
                "the checkpoint in cold",
            ],
            rows,
        ),
    )
