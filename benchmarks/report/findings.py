"""The report's findings (``finding.F*`` blocks of ``template.md``): the figures they
quote from this run, and which finding explains a missed target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.infra.measure import MiB
from benchmarks.report import analysis as A
from benchmarks.report.tables import Lines, share
from benchmarks.report.template import block, blocks, paragraph

# Which findings explain a missed target, by Target.key prefix.
CAUSES: dict[str, tuple[str, ...]] = {
    "hot_disk": ("F2",),
    "load_hot": ("F3",),
    "crc": ("F3",),
}


def finding(ident: str) -> tuple[str, str]:
    """The title and the text (with placeholders) of finding ``ident``."""
    title, text = blocks()[f"finding.{ident}"].split("\n\n", 1)
    return title, text


def identifiers() -> list[str]:
    return [name.removeprefix("finding.") for name in blocks() if name.startswith("finding.")]


def explain(target: A.Target) -> str:
    """Why ``target`` was missed: the findings that explain it, and noise where its per-rep
    range straddles the bound."""
    reasons = []
    found = [f for key, ids in CAUSES.items() if target.key.startswith(key) for f in ids]
    if found:
        reasons.append("see " + ", ".join(f"{f} ({finding(f)[0]})" for f in found))
    if straddles(target):
        reasons.append(block("targets.noise"))
    return "; ".join(reasons) + "." if reasons else "not explained yet."


def findings(results: Mapping[str, Any]) -> Lines:
    values = {"fsync_share": _fsync_share(results), **cpu_values(results), **disk_values(results)}
    out = paragraph("findings")
    for ident in identifiers():
        title, text = finding(ident)
        out += [f"**{ident}: {title}.** " + text.format_map(values), ""]
    return out


def cpu_values(results: Mapping[str, Any]) -> dict[str, str]:
    """F1's numbers, from this run's CPU-only measurements."""
    costs = A.cpu_costs(results)
    save, bare = A.med(costs, "torch_save"), A.med(costs, "torch_save_nozipcrc")
    fsw = A.med(costs, "fsw_tmpfs")
    tmpfs = A.div(fsw, A.med(costs, "tiered_tmpfs"))
    return {
        "zip_crc": "n/a" if save is None or bare is None else f"{save - bare:.3f}",
        "crc32c": "n/a" if "crc32c" not in costs else f"{costs['crc32c']['median']:.3f}",
        "tmpfs": "n/a" if tmpfs is None else f"{tmpfs:.2f}x",
    }


def disk_values(results: Mapping[str, Any]) -> dict[str, str]:
    """F2's numbers: the disk baseline's rate and FileSystemWriter's share of it, by size."""
    rates, shares = [], []
    for size in A.save_sizes(results):
        rate = A.throughput(A.save_records(results, size), "commit")
        disk, fsw = A.med(rate, "disk_sync"), A.med(rate, "fsw_sync")
        if disk:
            rates.append(f"{disk / MiB:.0f} MiB/s at {size // MiB} MiB")
            shares.append(f"{A.div(fsw, disk) or 0:.2f}x at {size // MiB} MiB")
    return {"disk_rate": ", ".join(rates) or "n/a", "fsw_vs_disk": ", ".join(shares) or "n/a"}


def _fsync_share(results: Mapping[str, Any]) -> str:
    """The disk baseline's share of time in fsync, over every save size."""
    found = A.fsync_share(A.all_save_records(results))
    return "an unmeasured share" if found is None else share(found)


def straddles(target: A.Target) -> bool:
    """Whether the per-rep range in ``target.detail`` contains the bound."""
    if not target.detail.startswith("per-rep "):
        return False
    try:
        low, high = (float(x.strip(";,x")) for x in target.detail.split()[1:4:2])
    except ValueError:
        return False
    return low <= target.bound <= high
