"""The benchmark report, docs/benchmarks.md, is written by hand around the tables and figures a
run generates: each generated part sits between two marker lines, every part the report names
has the code that writes it, and a run replaces the parts it measured and nothing else. The
report is organised by the questions a user asks, in a fixed order, and cites no issue. The
figures need matplotlib (the bench extra): without it each figure's place says it was not
drawn. ``tests/data/bench-smoke.json`` is the results of one ``make bench-smoke`` run (every
suite, tiny sizes)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.infra.measure import MiB
from benchmarks.report import render
from benchmarks.report.tables import DOC

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


def test_every_part_of_the_report_has_its_code_and_every_part_is_in_the_report() -> None:
    text = DOC.read_text()
    assert list(render.parts(text)) == list(render.PARTS)  # each once, in the report's order
    assert text.count("<!-- generated: ") == text.count("<!-- end generated -->") == len(render.PARTS)


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


def test_a_run_fills_the_tables_of_what_it_measured(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = tmp_path / "benchmarks.md"
    done = render.write(small_results(), doc)
    assert {"run", "machine", "targets", "save.stall", "hot", "memory.save", "cold-down"} <= set(done)
    made = render.parts(doc.read_text())
    assert "**32 MiB** (seconds: median (min-max))" in made["save.stall"]
    assert "| `tiered_sync` | 1.10 (1.10-1.10) | 1.100x |" in made["save.stall"]
    assert "- `fsw_async` failed: it broke" in made["save.stall"]
    assert "- `sync@refuse` failed: refused" in made["cold-down"]
    assert "| **refusing connections** |" in made["cold-down"] and "| 2 failed |" in made["cold-down"]
    assert "Disk baseline's time in fsync: 50% (median; 50%-50%)" in made["hot"]
    assert "| started | 2026-01-01 00:00:00 |" in made["run"]
    assert (tmp_path / "img" / "benchmarks" / "save_stall.png").stat().st_size > 0
    assert "![save stall ratios](img/benchmarks/save_stall.png)" in made["save.stall"]


def test_a_report_not_there_yet_starts_as_a_copy_of_the_hand_written_one(tmp_path: Path) -> None:
    doc = tmp_path / "smoke" / "benchmarks.md"
    render.write(small_results(), doc)
    text, docs = doc.read_text(), DOC.read_text()
    outside = re.compile(r"<!-- generated: .*?<!-- end generated -->", re.S)
    assert outside.split(text) == outside.split(docs)  # the prose is the report's, word for word


def test_a_run_of_one_suite_replaces_its_parts_and_nothing_else(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.read_text())
    results = small_results()
    del results["suites"]["save"]
    assert render.write(results, doc) == ["cold-down"]
    before, after = render.parts(DOC.read_text()), render.parts(doc.read_text())
    assert {name for name in after if after[name] != before[name]} == {"cold-down"}
    text = doc.read_text()
    assert (
        "<!-- generated: cold-down; measured 2026-01-01 00:00:00, profile quick -->\n\n| cold tier |" in text
    )
    assert (
        text.replace(after["cold-down"], before["cold-down"]).split("<!-- generated: cold-down")[0]
        == (DOC.read_text().split("<!-- generated: cold-down")[0])
    )


def test_a_part_the_code_does_not_know_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- generated: nosuch -->\n\nold\n\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="nosuch"):
        render.write(small_results(), doc)
    assert "old" in doc.read_text()


def smoke_report(tmp_path: Path) -> str:
    doc = tmp_path / "benchmarks.md"
    render.write(json.loads(SMOKE.read_text()), doc)
    return doc.read_text()


def test_the_report_follows_the_questions_and_cites_no_issue(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    assert [line for line in text.splitlines() if line.startswith("## ")] == HEADINGS
    assert re.search(r"\bissues? #?\d", text, re.IGNORECASE) is None
    assert re.search(r"\b(item|section)s? \d", text) is None
    targets = render.parts(text)["targets"]
    assert "| question | measure | ratio | target | from | verdict | noise |" in targets
    rows = [row for row in targets.splitlines() if row.startswith("| ")][1:]
    questions = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    order = ["Stall", "Save", "Load", "Migration", "Memory", "Scale"]
    assert questions == sorted(questions, key=order.index) and set(questions) == set(order)
    assert "| design target |" in targets


def test_each_part_of_the_perf_suite_is_under_its_question(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    for part, question in (
        ("<!-- generated: perf.stall.targets", "## Stall"),
        ("<!-- generated: perf.save.targets", "## Save"),
        ("<!-- generated: loop.reps", "## Save"),
        ("<!-- generated: perf.load.targets", "## Load"),
        ("<!-- generated: memory.migration", "## Memory"),
        ("<!-- generated: gpu", "## Stall"),
    ):
        above = [line for line in text[: text.index(part)].splitlines() if line.startswith("## ")]
        assert above[-1].startswith(question), part


def test_a_second_write_of_the_same_results_changes_nothing(tmp_path: Path) -> None:
    text = smoke_report(tmp_path)
    render.write(json.loads(SMOKE.read_text()), tmp_path / "benchmarks.md")
    assert (tmp_path / "benchmarks.md").read_text() == text


def test_without_matplotlib_every_table_is_written_and_each_figure_says_it_was_not_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.report import plots

    monkeypatch.setattr(plots, "plt", None)
    made = render.parts(smoke_report(tmp_path))
    assert "](img/" not in "".join(made.values())
    assert "*Figure not drawn (save stall ratios): matplotlib is not installed here" in made["save.stall"]
    assert not (tmp_path / "img").exists() or not any((tmp_path / "img").rglob("*.png"))
    assert "| rep |" in made["loop.reps"]
