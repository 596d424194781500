"""The report's Preemption tables: saving on a preemption notice (``benchmarks/jobs/preemption.py``),
then from the signal to the exit of a 2-rank job, per training loop (``preemption_exit.py``)."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report.tables import table

COLDS = {"local": "a local directory", "s3": "S3 (moto)"}
# The exit job's set-ups, in the report's order: the row's name and how its process ends.
LOOPS = {
    "readme": (
        "the README's loop (never reads `preempted`)",
        "at the `save()` after the notice's: the manager closes the run, then SIGTERM's default action",
    ),
    "preempted": (
        "the documented loop (`if manager.save(step, state) and manager.preempted: break`)",
        "the loop breaks at the notice's step, `close()`, the script's end",
    ),
    "lightning": (
        "Lightning, `TierstoreCheckpoint` (`python train.py`, its own launcher)",
        "`SIGTERMException` on every rank at the notice's batch, raised through the script's end",
    ),
    "torchtitan": (
        "torchtitan, `TieredCheckpointManager` (trainer stops on `checkpointer.preempted`)",
        "the trainer stops at the notice's step, `close()`, the script's end",
    ),
}


def _values(records: list[dict[str, Any]], variant: str, field: str) -> list[float]:
    return [r[field] for r in records if r["variant"] == variant and r.get(field) is not None]


def _cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    best, worst = min(values), max(values)
    return f"{best:.3f} (spread {worst / best:.2f}x)" if best > 0 else f"{best:.3f}"


def _code(code: int | None) -> str:
    """An exit code as Popen gives it (-N: ended by signal N); ``?``: not seen."""
    if code is None:
        return "?"
    try:
        return f"{code} ({signal.Signals(-code).name})" if code < 0 else str(code)
    except ValueError:
        return str(code)


def _committed(records: list[dict[str, Any]], field: str) -> str:
    """Seconds from the signal to a commit, best and spread; the reps that had none, named."""
    values = [r[field] for r in records if r.get(field) is not None]
    cell = _cell(values)
    if len(values) < len(records):
        cell += f", **none in {len(records) - len(values)} of {len(records)} reps**"
    return cell


def _codes(records: list[dict[str, Any]]) -> str:
    """Each rank's exit code, and in how many reps, where the reps differ."""
    seen = Counter(" / ".join(_code(c) for c in r["codes"]) for r in records)
    if len(seen) == 1:
        return next(iter(seen))
    return "; ".join(f"{codes} ({n} of {len(records)})" for codes, n in seen.most_common())


def _left(records: list[dict[str, Any]]) -> str:
    """The least grace period left at the exit, in seconds and as a share; a rep whose job
    outlived the grace period is named."""
    late = [r for r in records if r.get("left") is None or r["left"] < 0]
    if late:
        return f"**none: {len(late)} of {len(records)} reps ran past the grace period**"
    least = min(records, key=lambda r: r["left"])
    return f"{least['left']:.1f} ({100 * least['left'] / least['grace']:.0f}%)"


def exit_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    """From the signal to every process's exit, per training loop; "" without that job."""
    suite = (results["suites"].get("preemption") or {}).get("exit")
    if not suite:
        return ""
    records = suite["records"]
    rows = []
    for loop, (name, ends) in LOOPS.items():
        skipped = [r["skipped"] for r in records if r["variant"] == loop and "skipped" in r]
        if skipped:
            rows.append([name, f"not run: {skipped[0]}", *["-"] * 5])
            continue
        mine = [r for r in records if r["variant"] == loop]
        if not mine:
            continue
        rows.append(
            [
                name,
                ends,
                _codes(mine),
                _committed(mine, "hot"),
                _committed(mine, "cold"),
                _cell(_values(mine, loop, "exit")),
                _left(mine),
            ]
        )
    return table(
        [
            "training loop",
            "how the process ends",
            "exit codes (rank 0 / rank 1)",
            "signal to hot commit, s",
            "signal to cold commit, s",
            "signal to every process gone, s",
            "grace period left at the exit (least), s",
        ],
        rows,
    )


def preemption_part(results: Mapping[str, Any], img: Path | None = None) -> str:
    suite = results["suites"].get("preemption")
    if not suite:
        return ""
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
    return table(
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
    )
