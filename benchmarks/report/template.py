"""The report's prose, ``template.md``: named blocks of markdown with ``{placeholders}``.

A block starts at a line ``<!-- block: NAME -->`` and runs to the next one. The template is
wrapped for reading; :func:`block` joins the lines of each paragraph and list item back
into one, so the report keeps one line per paragraph (diffs of two runs stay readable).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("template.md")
_MARKER = re.compile(r"<!-- block: ([\w.]+) -->")
_PLACEHOLDER = re.compile(r"\{\w+\}")
# A line that starts one of these begins a new element instead of continuing the last.
_STARTS = ("#", "|", "- ", "![", "<!--")


@functools.cache
def blocks() -> dict[str, str]:
    """Every block of the template by name, its paragraphs joined, blank lines trimmed."""
    found: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in TEMPLATE.read_text().splitlines():
        marker = _MARKER.fullmatch(line.strip())
        if marker:
            lines = found.setdefault(marker.group(1), [])
        elif lines is not None:
            lines.append(line)
    return {name: "\n".join(_join(lines)).strip("\n") for name, lines in found.items()}


def _stands_alone(line: str) -> bool:
    return line.startswith(_STARTS) or _PLACEHOLDER.fullmatch(line) is not None


def _continues(previous: str, line: str) -> bool:
    """Whether template ``line`` goes on with the paragraph or list item ``previous``."""
    text = line.strip()
    if not previous or not text or _stands_alone(text):
        return False
    if previous.startswith("- "):
        return line[:1].isspace()  # a list item's later lines are indented
    return not _stands_alone(previous)


def _join(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if out and _continues(out[-1], line):
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
    return out


def block(name: str, /, **values: Any) -> str:
    """Block ``name`` with its placeholders filled from ``values``."""
    return blocks()[name].format_map(values)


def paragraph(name: str, /, **values: Any) -> list[str]:
    """Block ``name`` filled, as report lines ending with a blank one."""
    return [*block(name, **values).split("\n"), ""]
