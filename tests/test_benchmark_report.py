"""The benchmark report's prose lives in benchmarks/report/template.md: its blocks are joined
back into one line per paragraph, every placeholder is filled from the results, and a splice
replaces one section of an existing report without touching the rest. Rendering needs
matplotlib (the bench extra); those tests are skipped without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.infra.measure import MiB
from benchmarks.report import template


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
    assert save[:2] == ["## 1. Save stall", ""]
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
    pytest.importorskip("matplotlib")
    from benchmarks.report import render

    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\nkept\n\n## 9. Save with the cold tier down\n\nold text\n\n## Findings\n\nkept too\n"
    )
    results = small_results()
    del results["suites"]["save"]
    assert render.splice(results, doc) == ["cold-down"]
    text = doc.read_text()
    assert "old text" not in text and "Seconds are the best of 1 reps" in text
    assert text.startswith("# Benchmarks\n\nkept\n\n## 9. Save with the cold tier down\n\n")
    assert text.endswith("\n\n## Findings\n\nkept too\n")
