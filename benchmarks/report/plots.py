"""The report's figures (matplotlib, Agg): small PNGs, every axis a ratio or a rate.

matplotlib comes with the bench extra (``make bench`` installs it). Without it the report is
still written, its text and tables whole, and each figure says it was not drawn: the report's
tests run in ``make test``, whose environment has no matplotlib."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

plt: Any
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # no bench extra: no figures
    plt = None

COLORS = {
    "tiered": "#1b7837",
    "fsw": "#2166ac",
    "fsspec": "#b2182b",
    "s3torch": "#e08214",
    "disk": "#555555",
    "fsr": "#2166ac",
    "s3fs": "#b2182b",
    "crc": "#999999",
    "ours": "#1b7837",
    "dcp": "#2166ac",
    "torch": "#e08214",
    "sync": "#555555",
    "raw": "#555555",
}
DPI = 80
Points = Mapping[Any, float]  # x (int or float) -> y


def color(name: str) -> str:
    return COLORS.get(name.split("_")[0], "#666666")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def bars(
    path: Path,
    title: str,
    ylabel: str,
    groups: Mapping[str, Mapping[str, float]],
    *,
    log: bool = False,
    reference: float | None = None,
) -> Path | None:
    """Grouped bars: ``groups[group][series] = value``; one colour per series. None where
    matplotlib is not installed."""
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        xs = [g + i * width for g, values in enumerate(groups.values()) if name in values]
        ys = [values[name] for values in groups.values() if name in values]
        ax.bar(xs, ys, width, label=name, color=color(name), alpha=0.55 + 0.45 * (i % 2))
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups))
    _finish(ax, title, ylabel, log=log, reference=reference)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, Points],
    *,
    log: bool = False,
    reference: float | None = None,
    xticks: Sequence[float] | None = None,
) -> Path | None:
    """One line per series. None where matplotlib is not installed."""
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name, color=color(name))
    if xticks is not None:
        ax.set_xticks(list(xticks))
    ax.set_xlabel(xlabel)
    _finish(ax, title, ylabel, log=log, reference=reference)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _finish(ax: Axes, title: str, ylabel: str, *, log: bool, reference: float | None) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8, linestyle="--")
    ax.grid(axis="y", alpha=0.3)
