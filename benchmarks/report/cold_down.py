"""The report's Cold tier down table: saves with the cold tier down (``benchmarks/jobs/cold_down.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import joined, table

COLD_DOWN_TARGET = 1.5  # a save with the cold tier down: within 1.5x of hot-only
COLD_DOWN_MODES = {
    "healthy": "**healthy**",
    "refuse": "**refusing connections**",
    "stall": "**stalled** (never answers)",
    "deny_writes": "**denying writes** (403)",
}
# (kind of save, field) of each column: dcp.save wall time and CPU, async_save stall and commit
MEASURES = (("sync", "commit"), ("sync", "cpu"), ("async", "stall"), ("async", "commit"))


def cold_down_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = results["suites"].get("cold-down")
    if not suite:
        return ""
    best = {field: A.best_of(suite["records"], field) for field in ("commit", "cpu", "stall")}
    rows = []
    for mode, text in COLD_DOWN_MODES.items():
        base_cells, cells = [], []
        for kind, field in MEASURES:
            value = best[field].get(f"{kind}@{mode}")
            base = best[field].get(f"{kind}@hot_only/{mode}")
            ratio = A.div(value, base)
            base_cells.append("n/a" if base is None else f"{base:.3f}")
            cells.append(
                "n/a" if value is None else f"{value:.3f} ({ratio:.2f}x)" if ratio else f"{value:.3f}"
            )
        paired = A.paired_medians(suite["records"], mode)
        states = A.migration_states(suite, mode)
        rows.append([f"hot only, paired with {mode}", *base_cells, "", "", ""])
        rows.append(
            [
                text,
                *cells,
                "save {}, stall {}, commit {}".format(*("n/a" if v is None else f"{v:.2f}x" for v in paired)),
                _verdict(suite, mode, paired),
                ", ".join(f"{count} {state}" for state, count in states.items()) or "-",
            ]
        )
    broken = "\n".join(f"- `{name}` failed: {error[:300]}" for name, error in suite.get("broken", {}).items())
    return joined(
        table(
            [
                "cold tier",
                "dcp.save s",
                "dcp.save CPU s",
                "async_save stall s",
                "async_save commit s",
                "per-rep paired ratio, median",
                "verdict",
                "migrations at the end",
            ],
            rows,
        ),
        broken,
    )


def _verdict(suite: Mapping[str, Any], mode: str, paired: list[float | None]) -> str:
    """Failed if a save failed; else judged on the worst paired median."""
    worst = max((v for v in paired if v is not None), default=None)
    failed = [v for v in (f"sync@{mode}", f"async@{mode}") if v in suite.get("broken", {})]
    return (
        f"**failed** ({', '.join(failed)})"
        if failed
        else "n/a"
        if worst is None
        else "met"
        if worst <= COLD_DOWN_TARGET
        else f"**missed** ({worst:.2f}x)"
    )
