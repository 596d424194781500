"""The report's frame: the run, the machine, the targets table and the profile's settings."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.infra.measure import GiB
from benchmarks.report import analysis as A
from benchmarks.report.tables import QUESTIONS, table

SOURCES = {"design": "design target", "ours": "this report", "what-if": "what-if"}


def run_part(results: Mapping[str, Any], img: Path) -> str:
    """The run: its command, when, how long, how many reps; only a run of every suite."""
    if "save" not in results["suites"]:  # a run of a few suites: the last whole run stays
        return ""
    profile = results["profile"]
    command = "make bench" if profile["name"] == "quick" else "make bench-full"
    rows = [
        ["command", f"`{command}` (`python -m benchmarks --profile {profile['name']}`)"],
        ["started", results["started"]],
        ["minutes", f"{results['seconds'] / 60:.1f}"],
        [
            "reps",
            f"{profile['reps']} of anything that touches S3, {profile['local_reps']} of the local saves "
            f"next to them, {profile['hot_only_reps']} at the local-only sizes, "
            f"{profile['scaling_reps']} in the scaling runs",
        ],
        ["raw results", f"`benchmarks/results/{profile['name']}.json` (not committed)"],
    ]
    return table(["run", ""], rows)


def machine_part(results: Mapping[str, Any], img: Path) -> str:
    if "save" not in results["suites"]:
        return ""
    m = results["machine"]
    disk = m["disk"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
    rows = [
        ["CPU", f"{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable)"],
        ["memory", f"{m['memory_bytes'] / GiB:.1f} GiB"],
        [
            "disk (hot tier)",
            f"{disk['device']} ({disk['kind']}), {disk['fstype']} on "
            f"{disk['mount']}, {disk['size_bytes'] / GiB:.0f} GiB",
        ],
        ["OS / Python", f"{m['os']}, Python {m['python']}"],
        ["packages", packages],
        [
            "fio",
            "installed"
            if m["fio"]
            else "not installed: the disk baseline is a Python write + fsync loop (below)",
        ],
        ["GPU", _gpu_line(results)],
        ["s3torchconnector", _s3torch_line(results)],
    ]
    return table(["", ""], rows)


def _gpu_line(results: Mapping[str, Any]) -> str:
    gpu = results["suites"].get("gpu")
    if not gpu:
        return "not run"
    return f"skipped: {gpu['reason']}" if gpu.get("skipped") else str(gpu.get("device", "yes"))


def _s3torch_line(results: Mapping[str, Any]) -> str:
    probe = results.get("s3torch", {})
    state = "reaches the local server" if probe.get("available") else "**not measured**"
    return f"{probe.get('version', 'n/a')}: {state} ({probe.get('reason', 'not probed')})"


def targets_part(results: Mapping[str, Any], img: Path) -> str:
    """Every target of the run but the perf suite's (which has tables of its own)."""
    found = A.all_targets(results)
    if not found or "save" not in results["suites"]:  # a run of a few suites: a few targets only
        return ""
    rows = [
        [
            QUESTIONS[t.question],
            t.what,
            A.fmt_value(t),
            A.fmt_bound(t),
            SOURCES[t.source],
            A.verdict(t),
            t.detail,
        ]
        for t in found
    ]
    return table(["question", "measure", "ratio", "target", "from", "verdict", "noise"], rows)


def profile_part(results: Mapping[str, Any], img: Path) -> str:
    """The profile's settings, as the run had them."""
    if "save" not in results["suites"]:
        return ""
    profile = results["profile"]
    settings = ", ".join(f"{k}={v}" for k, v in profile.items() if k != "name")
    return f"Profile `{profile['name']}`: {settings}."
