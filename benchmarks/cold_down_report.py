"""The report's section for item 9: saves with the cold tier down (``benchmarks/cold_down.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks import analysis as A
from benchmarks.markdown import Lines, size_label, table
from benchmarks.measure import paired_ratios

COLD_DOWN_TARGET = 1.5  # issue 11: a save with the cold tier down, within 1.5x of hot-only
COLD_DOWN_MODES = {"healthy": "**healthy**", "refuse": "**refusing connections**",
                   "stall": "**stalled** (never answers)",
                   "deny_writes": "**denying writes** (403)"}


def cold_down_section(results: Mapping[str, Any]) -> Lines:
    suite = results["suites"].get("cold-down")
    if not suite:
        return []
    best = {field: _best(suite["records"], field) for field in ("commit", "cpu", "stall")}
    measures = (("sync", "commit"), ("sync", "cpu"), ("async", "stall"), ("async", "commit"))
    rows = []
    for mode, text in COLD_DOWN_MODES.items():
        base_cells, cells = [], []
        for kind, field in measures:
            value = best[field].get(f"{kind}@{mode}")
            base = best[field].get(f"{kind}@hot_only/{mode}")
            ratio = A.div(value, base)
            base_cells.append("n/a" if base is None else f"{base:.3f}")
            cells.append("n/a" if value is None else
                         f"{value:.3f} ({ratio:.2f}x)" if ratio else f"{value:.3f}")
        paired = _paired(suite["records"], mode)
        worst = max((v for v in paired if v is not None), default=None)
        failed = [v for v in (f"sync@{mode}", f"async@{mode}") if v in suite.get("broken", {})]
        verdict = (f"**failed** ({', '.join(failed)})" if failed else "n/a" if worst is None else
                   "met" if worst <= COLD_DOWN_TARGET else f"**missed** ({worst:.2f}x)")
        rows.append([f"hot only, paired with {mode}", *base_cells, "", "", ""])
        rows.append([text, *cells, "save {}, stall {}, commit {}".format(
            *("n/a" if v is None else f"{v:.2f}x" for v in paired)), verdict,
            _migrations(suite, mode)])
    out = ["## 9. Save with the cold tier down", "",
           "Before issue 11's fix `TieredWriter` asked the cold tier whether the checkpoint "
           "already existed while planning each save: with S3 refusing connections `dcp.save` "
           "failed after about 7 s, with S3 stalled it blocked for 92 s. Now no step of a save "
           f"sends a request to the cold tier. Measured {results.get('started', '')}: one "
           f"process saves {size_label(suite['bytes'])} (16 MiB float32 tensors) with "
           "`TieredWriter` and an S3 cold tier reached through the fault proxy of the S3 tests "
           "(`backends/s3/tests/s3_fault_proxy.py`, its own process per mode). Each save is "
           "paired with a hot-only `TieredWriter` save of the same kind run right before or "
           "after it (alternating by rep): `dcp.save` wall time to commit and the process's "
           "CPU time over it, `dcp.async_save`'s stall and time to commit. The cold tier has "
           "the S3 tier's default timeouts and retries. Stalled: the proxy reads each request "
           "and never answers. Between measurements the healthy tier's uploads are drained and "
           "every save gets a 0.5 s pause (untimed: in training saves are minutes apart); "
           "against a down tier the migrator keeps retrying in the background meanwhile, and "
           "the CPU column includes what it spends during the save.", "",
           f"Seconds are the best of {suite['reps']} reps, with the ratio to the paired "
           "hot-only save's best. These saves take a fraction of a second, and one lucky rep "
           "moves a best-of ratio by a third on this shared VM, so the verdict is judged on the "
           "steadier figure next to them: the median over reps of each save's ratio to the "
           "hot-only save run next to it (`dcp.save` wall time, async stall, async commit). "
           f"Target (issue 11): within {COLD_DOWN_TARGET}x of hot-only. The last column counts "
           "the states the mode's migrators recorded by the end of the run (warm-up saves "
           "included): failures are recorded, never raised into the save; refused and stalled "
           "uploads are still being retried.", "",
           *table(["cold tier", "dcp.save s", "dcp.save CPU s", "async_save stall s",
                   "async_save commit s", "per-rep paired ratio, median", "verdict",
                   "migrations at the end"], rows)]
    for name, error in suite.get("broken", {}).items():
        out += [f"- `{name}` failed: {error[:300]}"]
    return out + ([""] if suite.get("broken") else [])


def _migrations(suite: Mapping[str, Any], mode: str) -> str:
    """What the mode's migrators recorded by the end of the run (warm-up saves included)."""
    states: dict[str, int] = {}
    for kind in ("sync", "async"):
        for state, count in suite.get("migrations", {}).get(f"{kind}@{mode}", {}).items():
            states[state] = states.get(state, 0) + count
    return ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "-"


def _paired(records: list[dict[str, Any]], mode: str) -> list[float | None]:
    """Median over reps of each save's ratio to its paired hot-only save (same rep), for
    the ``dcp.save`` wall time, the async stall and the async commit."""
    medians: list[float | None] = []
    for kind, field in (("sync", "commit"), ("async", "stall"), ("async", "commit")):
        pair = paired_ratios([r for r in records if r.get("against") == mode and r["kind"] == kind],
                             field, f"{kind}@{mode}", f"{kind}@hot_only/{mode}")
        medians.append(None if pair is None else pair["median"])
    return medians


def _best(records: list[dict[str, Any]], field: str) -> dict[str, float]:
    """The smallest value of ``field`` per variant over its reps (errors left out)."""
    out: dict[str, float] = {}
    for record in records:
        value = record.get(field)
        if value is not None and not record.get("error"):
            name = str(record["variant"])
            out[name] = min(out.get(name, value), value)
    return out
