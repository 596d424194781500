"""Log-log plots of requests against W, one line per phase (matplotlib: the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.scale.results import Measurement
from benchmarks.scale.sim import PHASES

__all__ = ["plot_requests"]


def plot_requests(ms: Sequence[Measurement], backend: str, path: Path) -> Path | None:
    """Coordinator requests (solid) and the worst rank's (dashed) per phase; ``None`` when
    matplotlib is missing or there is a single W."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ms = sorted(ms, key=lambda m: m.world)
    if len(ms) < 2:
        return None
    worlds = [m.world for m in ms]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for index, phase in enumerate(PHASES):
        color = f"C{index}"
        if any(m.phases[phase].coord_requests for m in ms):  # zero has no place on a log axis
            coord = [max(m.phases[phase].coord_requests, 1) for m in ms]
            ax.plot(worlds, coord, "-o", color=color, label=f"{phase} (coordinator)")
        if any(m.phases[phase].ranks for m in ms):
            ranks = [max(m.phases[phase].rank_requests_max, 1) for m in ms]
            ax.plot(worlds, ranks, "--x", color=color, label=f"{phase} (worst rank)")
    ax.plot(
        worlds,
        [w / 1000 + w / 64 + 10 for w in worlds],
        ":",
        color="black",
        label="cold commit bound W/1000+W/64+10",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("requests per phase")
    ax.set_title(f"tierstore requests vs W ({backend})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
