"""Write ``docs/benchmarks.md`` and its figures (``docs/img/benchmarks/``) from a results
dict, or splice the sections of standalone suites into the report already there."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.report import analysis as A
from benchmarks.report import sections as S
from benchmarks.report.cold_down import cold_down_section
from benchmarks.report.findings import findings
from benchmarks.report.overview import header, machine, method, targets
from benchmarks.report.perf import perf_section
from benchmarks.report.preemption import preemption_section
from benchmarks.report.tables import DOC, FIGURES, Lines

Section = Callable[[Mapping[str, Any], Path], Lines]

SECTIONS: tuple[Section, ...] = (
    S.save_section,
    S.latency_section,
    S.hot_section,
    S.migration_section,
    S.load_section,
    S.memory_section,
    S.scaling_section,
    S.gpu_section,
    cold_down_section,
    perf_section,
    preemption_section,
)
# Sections rendered from their own suite alone: a run of only those suites can update them in
# the report without the rest (``--only cold-down --splice``).
STANDALONE: dict[str, Section] = {
    "cold-down": cold_down_section,
    "perf": perf_section,
    "preemption": preemption_section,
}


def _text(lines: Lines) -> str:
    """The report's text: a placeholder left empty leaves no extra blank line."""
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip()


def render(results: Mapping[str, Any], img: Path) -> str:
    """The whole report; its figures are written into ``img``."""
    lines: Lines = [*header(results), *machine(results), *targets(A.all_targets(results))]
    for section in SECTIONS:
        lines += section(results, img)
    lines += findings(results)
    lines += method(results)
    return _text(lines) + "\n"


def write(results: Mapping[str, Any], doc: Path = DOC) -> Path:
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(results, doc.parent / FIGURES))
    return doc


def splice(results: Mapping[str, Any], doc: Path = DOC) -> list[str]:
    """Replace, in the existing report, the sections of the standalone suites in
    ``results`` (inserted before the findings if absent); the rest stays as it was.
    Returns the suites spliced."""
    text = doc.read_text()
    done = []
    for suite, render_section in STANDALONE.items():
        if suite not in results["suites"]:
            continue
        section = _text(render_section(results, doc.parent / FIGURES))
        heading = section.split("\n", 1)[0] + "\n"
        start = text.find(heading)
        if start < 0:
            start = end = text.index("## Findings\n")
        else:
            following = text.find("\n## ", start + len(heading))
            end = len(text) if following < 0 else following + 1
        text = text[:start] + section + "\n\n" + text[end:]
        done.append(suite)
    doc.write_text(text)
    return done
