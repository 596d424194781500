"""The benchmark report's prose lives in benchmarks/report/template.md: its blocks are joined
back into one line per paragraph, every placeholder is filled from the results, and a splice
replaces one section of an existing report without touching the rest. The report is organised
by the questions a user asks, in a fixed order, and cites no issue. The figures need matplotlib
(the bench extra): without it the report is written whole with each figure marked not drawn,
so only the tests of the figures themselves are skipped. ``tests/data/bench-smoke.json`` is the
results of one ``make bench-smoke`` run (every suite, tiny sizes)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.infra.measure import MiB
from benchmarks.report import template

SMOKE = Path(__file__).parent / "data" / "bench-smoke.json"
# The report's top-level sections, in order: the questions, then the findings and the method.
HEADINGS = [
    "## Machine",
    "## Targets",
    "## Stall: how long does a save block training?",
    "## Save: how fast does a checkpoint reach the hot tier?",
    "## Load: how fast does a resume read?",
    "## Migration: how fast does it reach the cold tier?",
    "## Memory: what does it cost in RAM?",
    "## Cold tier down: what happens when S3 is unreachable?",
    "## Preemption: how soon is a checkpoint safe after SIGTERM?",
    "## Scale: how does it grow with ranks?",
    "## Findings",
    "## Method",
]


def test_a_wrapped_paragraph_becomes_one_line_and_elements_stay_apart() -> None:
    lines = [
        "# Title",
        "",
        "A paragraph",
        "wrapped here.",
        "{table}",
        "| a | b |",
        "| c | d |",
        "",
        "- an item",
        "  wrapped too",
        "- another",
        "",
        "{figure}",
        "last",
    ]
    assert template._join(lines) == [
        "# Title",
        "",
        "A paragraph wrapped here.",
        "{table}",
        "| a | b |",
        "| c | d |",
        "",
        "- an item wrapped too",
        "- another",
        "",
        "{figure}",
        "last",
    ]


def test_template_blocks_keep_one_line_per_paragraph() -> None:
    save = template.block("save").split("\n")
    assert save[:2] == ["### Save stall", ""]
    assert (
        len(save) == 3
        and save[2].startswith("Time the training thread")
        and save[2].endswith("Ratio = stall / FileSystemWriter sync stall.")
    )
    method = template.block("method", profile="quick", settings="reps=3").split("\n")
    items = [line for line in method if line.startswith("- **")]
    assert len(items) == 10 and method[-1] == "Profile `quick`: reps=3."


def test_a_block_with_a_missing_value_fails_loudly() -> None:
    with pytest.raises(KeyError, match="size"):
        template.block("latency", table="", errors="", figure="")


def small_results() -> dict[str, Any]:
    size = 32 * MiB
    save = [
        {
            "variant": v,
            "rep": rep,
            "stall": s,
            "commit": 2 * s,
            "bytes": size,
            "cpu": s,
            "growth_save": 10 * MiB,
            **({"fsync": s} if v == "disk_sync" else {}),
        }
        for rep in range(2)
        for v, s in (("disk_sync", 0.5), ("fsw_sync", 1.0), ("tiered_sync", 1.1), ("tiered_async", 0.1))
    ]
    save.append({"variant": "fsw_async", "rep": 0, "error": "it broke"})
    cold = [
        {
            "variant": f"{kind}@{mode}",
            "kind": kind,
            "against": against,
            "rep": 0,
            "stall": 0.1,
            "commit": 0.2,
            "cpu": 0.1,
        }
        for against in ("healthy", "refuse", "stall", "deny_writes")
        for kind in ("sync", "async")
        for mode in (against, f"hot_only/{against}")
    ]
    machine = {
        "cpu": "cpu",
        "cores": 2,
        "usable_cores": 2,
        "memory_bytes": 1 << 33,
        "disk": {"device": "/dev/x", "kind": "disk", "fstype": "ext4", "mount": "/", "size_bytes": 1 << 36},
        "os": "Linux",
        "python": "3.11",
        "packages": {},
        "fio": False,
    }
    profile = {
        "name": "quick",
        "reps": 2,
        "local_reps": 2,
        "hot_only_reps": 1,
        "scaling_reps": 1,
        "hot_only_sizes": [],
    }
    return {
        "profile": profile,
        "machine": machine,
        "started": "2026-01-01 00:00:00",
        "seconds": 60.0,
        "suites": {
            "save": {str(size): save},
            "cold-down": {
                "bytes": size,
                "reps": 1,
                "records": cold,
                "broken": {"sync@refuse": "refused"},
                "migrations": {"sync@refuse": {"failed": 2}},
            },
        },
    }


def test_the_report_fills_every_placeholder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.report import render

    doc = render.write(small_results(), tmp_path / "benchmarks.md")
    text = doc.read_text()
    assert "{" not in text and "}" not in text
    assert "\n\n\n" not in text
    assert "**32 MiB** (seconds: median (min-max))" in text
    assert "| `tiered_sync` | 1.10 (1.10-1.10) | 1.100x |" in text
    assert "- `fsw_async` failed: it broke" in text
    assert "- `sync@refuse` failed: refused" in text
    assert "| **refusing connections** |" in text and "| 2 failed |" in text
    assert "The disk baseline spent 50% (median; 50%-50%) of its time in fsync" in text
    assert "**Skipped in this run**: not run." in text
    assert (tmp_path / "img" / "benchmarks" / "save_stall.png").stat().st_size > 0
    assert "![save stall ratios](img/benchmarks/save_stall.png)" in text


def test_splice_replaces_only_the_standalone_section(tmp_path: Path) -> None:
    from benchmarks.report import render

    doc = tmp_path / "benchmarks.md"
    heading = "## Cold tier down: what happens when S3 is unreachable?"
    doc.write_text(f"# Benchmarks\n\nkept\n\n{heading}\n\nold text\n\n## Findings\n\nkept too\n")
    results = small_results()
    del results["suites"]["save"]
    assert render.splice(results, doc) == ["cold-down"]
    text = doc.read_text()
    assert "old text" not in text and "Seconds are the best of 1 reps" in text
    assert text.startswith(f"# Benchmarks\n\nkept\n\n{heading}\n\n")
    assert text.endswith("\n\n## Findings\n\nkept too\n")


def smoke_report(tmp_path: Path) -> str:
    from benchmarks.report import render

    return render.write(json.loads(SMOKE.read_text()), tmp_path / "benchmarks.md").read_text()


def test_the_report_follows_the_questions_and_cites_no_issue(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    assert [line for line in text.splitlines() if line.startswith("## ")] == HEADINGS
    for prose in (text, template.TEMPLATE.read_text()):  # the template: blocks this run left out too
        assert re.search(r"\bissues? #?\d", prose, re.IGNORECASE) is None
        assert re.search(r"\b(item|section)s? \d", prose) is None
    assert "{" not in text and "}" not in text
    targets = text[text.index("## Targets") : text.index("### Missed targets")]
    assert "| question | measure | ratio | target | from | verdict | noise |" in targets
    rows = [row for row in targets.splitlines() if row.startswith("| ")][1:]
    questions = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    order = ["Stall", "Save", "Load", "Migration", "Memory", "Scale"]
    assert questions == sorted(questions, key=order.index) and set(questions) == set(order)
    assert "issue" not in targets.lower() and "| design target |" in targets


def test_each_part_of_the_perf_suite_is_under_its_question(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    for part, question in (
        ("### Staging paid once: the CheckpointManager against its peers", "## Stall"),
        ("### Raw encoding: a save's CPU and throughput", "## Save"),
        ("### Verified loads of the raw encoding", "## Load"),
        ("### Migration memory", "## Memory"),
        ("### GPU staging", "## Stall"),
    ):
        above = [line for line in text[: text.index(part)].splitlines() if line.startswith("## ")]
        assert above[-1].startswith(question), part


def test_a_splice_of_a_full_report_changes_nothing(tmp_path: Path) -> None:
    """Splicing every standalone suite of the run that wrote the report finds each of their
    sections where it stands and leaves the text as it was."""
    text = smoke_report(tmp_path)
    from benchmarks.report import render

    results = json.loads(SMOKE.read_text())
    assert render.splice(results, tmp_path / "benchmarks.md") == ["cold-down", "perf", "preemption"]
    assert (tmp_path / "benchmarks.md").read_text() == text


def test_a_perf_section_missing_from_the_report_goes_under_its_question(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    from benchmarks.report import render

    part = "### Raw encoding: a save's CPU and throughput"
    start = text.index(part)
    end = text.index("## Load:")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(text[:start] + text[end:])
    results = json.loads(SMOKE.read_text())
    results["suites"] = {"perf": results["suites"]["perf"]}
    assert render.splice(results, doc) == ["perf"]
    assert doc.read_text() == text


def test_without_matplotlib_the_report_is_whole_and_says_which_figures_it_did_not_draw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.report import plots, render

    monkeypatch.setattr(plots, "plt", None)
    text = render.write(json.loads(SMOKE.read_text()), tmp_path / "benchmarks.md").read_text()
    assert "{" not in text and "](img/" not in text
    assert "*Figure not drawn (save stall ratios): matplotlib is not installed here" in text
    assert not (tmp_path / "img").exists() or not any((tmp_path / "img").rglob("*.png"))
    assert "## Findings" in text and "### In a training loop" in text
