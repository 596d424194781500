"""Quarantine (issue 22, item 3; docs/design.md invariant 21): what a verified load proved
damaged is set aside, never kept in place of a good one, and only a person removes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import blank, file_path, flip, load, matches, saved
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import CheckpointManager, Retention, keep_last, list_checkpoints
from tierstore.cli import main
from tierstore.errors import CheckpointExists, CheckpointNotFound
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.quarantine import (
    delete_quarantined,
    list_quarantined,
    quarantine,
    restore_quarantined,
)
from tierstore.tiers.tier import Store, Tier


def test_quarantine_unpublishes_keeps_the_data_and_gc_keeps_it(hot_dir: str) -> None:
    saved(hot_dir, 1)
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    assert quarantine(tier, bad, "found damaged")
    assert [c.step for c in list_checkpoints(hot_dir)] == [1]  # no longer a checkpoint
    aside = list_quarantined(Store(hot_dir))
    assert [(q.name, q.attempt, q.step, q.reason) for q in aside] == [
        (bad.name, bad.attempt, 2, "found damaged")
    ]
    assert aside[0].size == bad.total_size
    report = collect_garbage(hot_dir, grace=0.0, dry_run=False)
    assert not any(bad.attempt in g.key for g in report.garbage)
    assert file_path(hot_dir, bad).exists()  # every byte still there
    assert quarantine(tier, bad, "again")  # twice is harmless: already aside


def test_the_step_is_saved_again_and_retention_counts_good_checkpoints(hot_dir: str) -> None:
    for step in (8, 9):
        saved(hot_dir, step)
    bad = saved(hot_dir, 10)
    quarantine(Tier("hot", hot_dir), bad, "found damaged")
    again = saved(hot_dir, 10)  # the re-trained step: a new attempt, committed
    assert again.attempt != bad.attempt
    prune(hot_dir, hot_policy=keep_last(2))
    assert [c.step for c in list_checkpoints(hot_dir)] == [9, 10]
    state, _ = load(hot_dir)
    assert matches(state, 10)
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [bad.attempt]


def test_delete_and_restore_are_by_hand_and_never_overwrite(hot_dir: str) -> None:
    saved(hot_dir, 1)
    bad = saved(hot_dir, 2)
    quarantine(Tier("hot", hot_dir), bad, "found damaged")
    restore_quarantined(Store(hot_dir), bad.name)  # not damaged after all: back in place
    assert [c.step for c in list_checkpoints(hot_dir)] == [1, 2] and not list_quarantined(Store(hot_dir))
    quarantine(Tier("hot", hot_dir), bad, "found damaged")
    saved(hot_dir, 2)  # the name is committed again by another attempt
    with pytest.raises(CheckpointExists):
        restore_quarantined(Store(hot_dir), bad.name)
    assert delete_quarantined(Store(hot_dir), bad.name, dry_run=True)
    assert file_path(hot_dir, bad).exists()  # a dry run deletes nothing
    delete_quarantined(Store(hot_dir), bad.name)
    assert not list_quarantined(Store(hot_dir)) and not file_path(hot_dir, bad).exists()
    assert [c.step for c in list_checkpoints(hot_dir)] == [1, 2]  # the new attempt is untouched
    with pytest.raises(CheckpointNotFound):
        delete_quarantined(Store(hot_dir), bad.name)


def test_an_unreadable_record_is_listed_and_its_data_kept(hot_dir: str) -> None:
    bad = saved(hot_dir, 3)
    quarantine(Tier("hot", hot_dir), bad, "found damaged")
    record = Path(hot_dir) / layout.quarantine_key(bad.name, bad.attempt)
    record.write_text("{not json")
    aside = list_quarantined(Store(hot_dir))
    assert len(aside) == 1 and "unreadable" in aside[0].reason and aside[0].manifest is None
    collect_garbage(hot_dir, grace=0.0, dry_run=False)
    assert file_path(hot_dir, bad).exists()


def test_a_crash_between_the_record_and_the_unpublish_is_finished_by_the_next_resume(hot_dir: str) -> None:
    saved(hot_dir, 1)
    bad = saved(hot_dir, 2)
    flip(file_path(hot_dir, bad))
    tier = Tier("hot", hot_dir)
    # What a crash right after the record leaves: the record, and the checkpoint still published.
    key = layout.quarantine_key(bad.name, bad.attempt)
    tier.backend.publish(
        key, json.dumps({"manifest": bad.to_json().decode(), "reason": "x", "when": 0}).encode()
    )
    with CheckpointManager(hot_dir, retention=Retention(hot_min_free=None)) as manager:
        target = blank()
        assert manager.load_latest(target) == 1 and matches(target, 1)
    assert [c.step for c in list_checkpoints(hot_dir)] == [1]
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [bad.attempt]


def test_nothing_is_quarantined_when_nothing_loads(hot_dir: str) -> None:
    for step in (1, 2):
        flip(file_path(hot_dir, saved(hot_dir, step)))
    with CheckpointManager(hot_dir, retention=Retention(hot_min_free=None)) as manager:
        with pytest.raises(CheckpointException):
            manager.load_latest(blank())
        assert manager.health().quarantined == ()
    assert [c.step for c in list_checkpoints(hot_dir)] == [1, 2]  # left for a person to look at


def test_the_cli_lists_removes_and_restores(hot_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    saved(hot_dir, 1)
    bad = saved(hot_dir, 2)
    quarantine(Tier("hot", hot_dir), bad, "found damaged in every tier")
    assert main(["ls", "--hot", hot_dir]) == 0
    out = capsys.readouterr().out
    assert "quarantined" in out and bad.name in out and "found damaged in every tier" in out
    assert main(["quarantine", "--hot", hot_dir]) == 0
    assert bad.attempt in capsys.readouterr().out
    assert main(["quarantine", "--hot", hot_dir, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["attempt"]) for r in rows] == [(bad.name, bad.attempt)]
    assert main(["quarantine", "--hot", hot_dir, "--delete", bad.name]) == 0  # dry run
    assert "would delete" in capsys.readouterr().out and file_path(hot_dir, bad).exists()
    assert main(["quarantine", "--hot", hot_dir, "--delete", "step-0000000009", "--yes"]) == 1
    capsys.readouterr()
    assert main(["quarantine", "--hot", hot_dir, "--delete", bad.name, "--yes"]) == 0
    assert not file_path(hot_dir, bad).exists()
    assert main(["quarantine", "--hot", hot_dir]) == 0
    assert "no quarantined checkpoints" in capsys.readouterr().out
