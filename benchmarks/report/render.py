"""Update ``docs/benchmarks.md`` from a run's results: its measured parts only.

The report is written by hand: its questions, what each measurement does, and what the
numbers mean. What a run measures (tables, figures, the lists of cases that failed) sits
between two marker lines, each part under a name of :data:`PARTS`::

    <!-- generated: save.stall -->

    | writer | stall s | ...

    <!-- end generated -->

:func:`write` replaces every part the run measured and leaves the others as they were, so a
run of one suite (``--only perf``) updates that suite's tables alone. The opening marker
records the run that measured the part. A report that does not exist yet (``--doc``
elsewhere, as ``make bench-smoke`` does) starts as a copy of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import cold_down, copies, loop, overview, perf, preemption
from benchmarks.report import sections as S
from benchmarks.report.tables import DOC, FIGURES

Part = Callable[[Mapping[str, Any], Path], str]

# Every generated part, in the report's order: what a run measured, as markdown ("" when the
# run did not measure it). The figures are drawn into the folder given.
PARTS: dict[str, Part] = {
    "run": overview.run_part,
    "machine": overview.machine_part,
    "targets": overview.targets_part,
    "save.stall": S.save_part,
    "save.latency": S.latency_part,
    "gpu": S.gpu_part,
    "perf.stall.targets": perf.stall_targets_part,
    "perf.stall": perf.stall_part,
    "hot": S.hot_part,
    "hot.cpu": S.cpu_part,
    "perf.save.targets": perf.save_targets_part,
    "perf.save": perf.save_part,
    "loop.targets": loop.targets_part,
    "loop.reps": loop.reps_part,
    "loop.pages": loop.pages_part,
    "load": S.load_part,
    "perf.load.targets": perf.load_targets_part,
    "perf.load": perf.load_part,
    "migration": S.migration_part,
    "memory.save": S.memory_part,
    "memory.migration": S.migration_memory_part,
    "cold-down": cold_down.cold_down_part,
    "copies.targets": copies.targets_part,
    "copies.stall": copies.stall_part,
    "copies.throughput": copies.throughput_part,
    "copies.restore": copies.restore_part,
    "preemption": preemption.preemption_part,
    "preemption.exit": preemption.exit_part,
    "scaling": S.scaling_part,
    "profile": overview.profile_part,
}
_PART = re.compile(r"^<!-- generated: ([\w.-]+)(?:;[^>]*)? -->\n(.*?)^<!-- end generated -->$", re.M | re.S)


def parts(text: str) -> dict[str, str]:
    """The generated parts of a report, by name: their text between the markers."""
    return {found.group(1): found.group(2).strip("\n") for found in _PART.finditer(text)}


def splice(text: str, results: Mapping[str, Any], img: Path) -> tuple[str, list[str]]:
    """``text`` with every part ``results`` measured replaced, and the names of those parts."""
    unknown = sorted(set(parts(text)) - set(PARTS))
    if unknown:
        raise ValueError(f"the report names generated parts no code writes: {unknown}")
    stamp = f"measured {results.get('started', '?')}, profile {results.get('profile', {}).get('name', '?')}"
    done: list[str] = []

    def replace(found: re.Match[str]) -> str:
        name = found.group(1)
        measured = PARTS[name](results, img).strip("\n")
        if not measured:  # not measured by this run: the part keeps what it had
            return found.group(0)
        done.append(name)
        return f"<!-- generated: {name}; {stamp} -->\n\n{measured}\n\n<!-- end generated -->"

    return _PART.sub(replace, text), done


def write(results: Mapping[str, Any], doc: Path = DOC) -> list[str]:
    """Update the parts of ``doc`` that ``results`` measured (figures beside it, in
    ``img/benchmarks/``); returns their names."""
    text = doc.read_text() if doc.exists() else DOC.read_text()
    text, done = splice(text, results, doc.parent / FIGURES)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return done
