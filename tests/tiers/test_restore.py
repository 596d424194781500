"""Restoring the hot tier from the cold one (tierstore.migration.restore) after losing it, and
replacing a damaged hot file. Finer-grained repairs: tests/tiers/test_restore_repair.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import file_path, load, matches, save

from tierstore import Store, list_checkpoints
from tierstore.format import layout
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.restore import restore
from tierstore.migration.status import wait_for_migrations
from tierstore.retry import RetryPolicy

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=5,
    retry=RetryPolicy(attempts=5, initial=0.001, maximum=0.01),
)


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "hot"), str(tmp_path / "cold")


def test_restore_after_losing_the_hot_tier(tiers) -> None:
    hot, cold = tiers
    for step in (1, 2):
        save(hot, step, cold, migration=FAST)
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    shutil.rmtree(hot)
    manifest = restore(Store.of(hot, cold))
    assert manifest.step == 2 and [c.step for c in list_checkpoints(hot)] == [2]
    target, reader = load(hot, None)  # hot alone now
    assert matches(target, 2) and reader.manifest == manifest
    assert restore(Store.of(hot, cold)) == manifest  # again: a no-op


def test_restore_replaces_a_damaged_hot_file(tiers) -> None:
    hot, cold = tiers
    manifest = save(hot, 1, cold, migration=FAST).manifest
    wait_for_migrations(Store.of(hot, cold), timeout=30)
    os.remove(Path(hot, layout.manifest_key(manifest.name)))
    path = file_path(hot, manifest, "__0_0.distcp")
    path.write_bytes(path.read_bytes()[:100])  # a half-restored file
    restore(Store.of(hot, cold))
    assert matches(load(hot, None)[0], 1)
