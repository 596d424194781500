"""The report's frame: the header, the machine, the targets table and the method."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.infra.measure import GiB
from benchmarks.report import analysis as A
from benchmarks.report.findings import explain
from benchmarks.report.tables import QUESTIONS, Lines, table
from benchmarks.report.template import paragraph

SOURCES = {"design": "design target", "ours": "this report", "what-if": "what-if"}


def header(results: Mapping[str, Any]) -> Lines:
    profile = results["profile"]
    return paragraph(
        "header",
        command="make bench" if profile["name"] == "quick" else "make bench-full",
        profile=profile["name"],
        started=results["started"],
        minutes=f"{results['seconds'] / 60:.1f}",
        reps=profile["reps"],
        local_reps=profile["local_reps"],
        hot_only_reps=profile["hot_only_reps"],
        scaling_reps=profile["scaling_reps"],
    )


def machine(results: Mapping[str, Any]) -> Lines:
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
    return paragraph("machine", table=table(["", ""], rows))


def _gpu_line(results: Mapping[str, Any]) -> str:
    gpu = results["suites"].get("gpu")
    if not gpu:
        return "not run"
    return f"skipped: {gpu['reason']}" if gpu.get("skipped") else str(gpu.get("device", "yes"))


def _s3torch_line(results: Mapping[str, Any]) -> str:
    probe = results.get("s3torch", {})
    state = "reaches the local server" if probe.get("available") else "**not measured**"
    return f"{probe.get('version', 'n/a')}: {state} ({probe.get('reason', 'not probed')})"


def targets(found: list[A.Target]) -> Lines:
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
    out = paragraph(
        "targets", table=table(["question", "measure", "ratio", "target", "from", "verdict", "noise"], rows)
    )
    missed = [t for t in found if t.met is False and t.source != "what-if"]
    if missed:
        out += paragraph("targets.missed")
        for t in missed:
            out += paragraph(
                "targets.miss", what=t.what, value=A.fmt_value(t), bound=A.fmt_bound(t), why=explain(t)
            )
    return out


def method(results: Mapping[str, Any]) -> Lines:
    profile = results["profile"]
    settings = ", ".join(f"{k}={v}" for k, v in profile.items() if k != "name")
    return paragraph("method", profile=profile["name"], settings=settings)
