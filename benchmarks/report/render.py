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
from benchmarks.report.loop import perf_loop_section
from benchmarks.report.overview import header, machine, method, targets
from benchmarks.report.perf import perf_load_section, perf_save_section, perf_stall_section
from benchmarks.report.preemption import preemption_section
from benchmarks.report.tables import DOC, FIGURES, Lines
from benchmarks.report.template import blocks

Section = Callable[[Mapping[str, Any], Path], Lines]

# The report by question, in order: a question's heading, then the sections that answer it.
SECTIONS: tuple[Section, ...] = (
    S.question("stall"),
    S.save_section,
    S.latency_section,
    S.gpu_section,
    perf_stall_section,
    S.question("save"),
    S.hot_section,
    perf_save_section,
    perf_loop_section,
    S.question("load"),
    S.load_section,
    perf_load_section,
    S.question("migration"),
    S.migration_section,
    S.memory_section,
    cold_down_section,
    preemption_section,
    S.scaling_section,
)
# Sections rendered from their own suite alone: a run of only those suites can update them in
# the report without the rest (``--only cold-down --splice``). Each is the suite's sections,
# with the question (block ``question.NAME``) whose section holds it, None for one that is a
# question's whole section.
STANDALONE: dict[str, tuple[tuple[str | None, Section], ...]] = {
    "cold-down": ((None, cold_down_section),),
    "perf": (
        ("stall", perf_stall_section),
        ("save", perf_save_section),
        ("save", perf_loop_section),
        ("load", perf_load_section),
    ),
    "preemption": ((None, preemption_section),),
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
    ``results``; the rest stays as it was. A section not there yet goes at the end of its
    question's section, or before the findings if that is absent too. Returns the suites
    spliced."""
    text = doc.read_text()
    done = []
    for suite, parts in STANDALONE.items():
        if suite not in results["suites"]:
            continue
        for parent, render_section in parts:
            section = _text(render_section(results, doc.parent / FIGURES))
            if section:  # a part this run did not measure keeps what the report has
                text = _replace(text, section, parent)
        done.append(suite)
    doc.write_text(text)
    return done


def _replace(text: str, section: str, parent: str | None) -> str:
    """``text`` with the section that starts with ``section``'s heading line replaced by
    ``section``: up to the next heading of its level or above."""
    heading = section.split("\n", 1)[0]
    start = _line(text, heading)
    if start >= 0:
        end = _next_heading(text, start + len(heading), _level(heading))
    else:
        above = _line(text, blocks()[f"question.{parent}"].split("\n", 1)[0]) if parent else -1
        start = end = _next_heading(text, above + 1, 2) if above >= 0 else _line(text, "## Findings")
        if start < 0:
            start = end = len(text)
    return text[:start] + section + "\n\n" + text[end:]


def _line(text: str, line: str) -> int:
    """Where the line ``line`` starts in ``text``, or -1."""
    found = re.search(f"^{re.escape(line)}$", text, re.M)
    return found.start() if found else -1


def _level(heading: str) -> int:
    return len(heading) - len(heading.lstrip("#"))


def _next_heading(text: str, pos: int, level: int) -> int:
    """Where the first heading of ``level`` or above after ``pos`` starts, or the end."""
    found = re.compile(f"^#{{1,{level}}} ", re.M).search(text, pos)
    return found.start() if found else len(text)
