"""Markdown pieces of the report's generated parts: tables, figure links, sizes and ranges, row
orders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from benchmarks.infra.measure import GiB, MiB

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
FIGURES = "img/benchmarks"  # the figures' folder, relative to the report's
# The report's questions, in the order of its sections: a target's ``question`` is a key, the
# targets table names it by the value.
QUESTIONS = {
    "stall": "Stall",
    "save": "Save",
    "load": "Load",
    "migration": "Migration",
    "memory": "Memory",
    "cold-down": "Cold tier down",
    "preemption": "Preemption",
    "scale": "Scale",
}

SAVE_ORDER = (
    "disk_sync",
    "fsw_sync",
    "fsw_async",
    "tiered_sync",
    "tiered_async",
    "fsspec_sync",
    "fsspec_async",
    "s3torch_sync",
    "s3torch_async",
)
LOCAL_ORDER = ("disk_sync", "fsw_sync", "tiered_sync", "fsw_async", "tiered_async")
LOAD_ORDER = (
    "fsr_hot",
    "tiered_hot",
    "tiered_hot_nocrc",
    "fsr_hot_warm",
    "tiered_hot_warm",
    "tiered_hot_nocrc_warm",
    "fsspec_cold",
    "tiered_cold",
    "tiered_cold_nocrc",
    "s3torch_cold",
    "crc_only",
)


def size_label(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB and n % GiB == 0 else f"{n // MiB} MiB"


def joined(*pieces: str) -> str:
    """A generated part of several pieces (captions, tables, figures): blank lines between, none
    for a piece left empty."""
    return "\n\n".join(piece for piece in pieces if piece)


def failed(records: Iterable[Mapping[str, object]]) -> str:
    """One list item per case that failed."""
    return "\n".join(f"- `{r['variant']}` failed: {str(r['error'])[:300]}" for r in records if r.get("error"))


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def image(path: Path | None, alt: str) -> str:
    """The figure's Markdown, or a line saying it was not drawn (no matplotlib)."""
    if path is None:
        return f"*Figure not drawn ({alt}): matplotlib is not installed here; `make bench` installs it.*"
    return f"![{alt}]({FIGURES}/{path.name})"


def spread(summary: Mapping[str, float] | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if summary is None:
        return "n/a"
    return (
        f"{fmt.format(summary['median'] * scale)} ({fmt.format(summary['min'] * scale)}"
        f"-{fmt.format(summary['max'] * scale)})"
    )


def share(summary: Mapping[str, float]) -> str:
    """A share of time: ``61% (median; 11%-64%)``."""
    return f"{summary['median']:.0%} (median; {summary['min']:.0%}-{summary['max']:.0%})"
