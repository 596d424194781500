"""The suite can fail: with the commit order broken on purpose (the manifest published
before DCP's metadata file is written), the state machine must find a checkpoint that is
listed as committed but does not load. (Missing fsyncs: see test_power_loss.py.)"""

from __future__ import annotations

import pickle
import time

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from machine import CrashConsistency
from stats import STATS

from tierstore import faults, layout
from tierstore._version import producer
from tierstore.backend import crc32c_update
from tierstore.manifest import FileEntry, Manifest
from tierstore.writer import TieredWriter


def finish_manifest_first(self: TieredWriter, metadata, results) -> None:  # type: ignore[no-untyped-def]
    """TieredWriter.finish with the bug: commit first, write the metadata it names after."""
    attempt = self._plan
    files, storage_data = {}, {}
    for rank_results in results:
        for result in rank_results:
            storage_data[result.index] = result.storage_data.info
            if result.storage_data.file is not None:
                files[result.storage_data.file.path] = result.storage_data.file
    metadata.storage_data = storage_data
    data = pickle.dumps(metadata)
    files[layout.METADATA_FILE] = FileEntry(layout.METADATA_FILE, len(data), crc32c_update(0, data), self._rank)
    manifest = Manifest(name=attempt.name, step=attempt.step, attempt=attempt.attempt,
                        world_size=len(results), created=time.time(),
                        files=tuple(sorted(files.values(), key=lambda f: (f.rank, f.path))),
                        producer=producer())
    self.hot.publish_manifest(manifest)  # BUG: the manifest is published before...
    faults.point("writer.after_manifest_publish")
    with self.hot.backend.open_write(self.hot.file_key(attempt.name, attempt.attempt,
                                                       layout.METADATA_FILE)) as out:
        out.write(data)  # ...the file it vouches for exists
    self.manifest = manifest
    if self.migrator is not None:
        self.migrator.submit_commit(manifest, self._rank)


def test_state_machine_catches_manifest_published_before_data(monkeypatch) -> None:
    monkeypatch.setattr(TieredWriter, "finish", finish_manifest_first)
    violations_before = STATS.violations
    with pytest.raises(AssertionError, match="does not load|not committed|vanished"):
        run_state_machine_as_test(CrashConsistency, settings=settings(
            max_examples=80, stateful_step_count=8, phases=[Phase.generate],
            derandomize=True, database=None, deadline=None))
    assert STATS.violations > violations_before
    STATS.violations = violations_before  # an expected catch, not a violation of the product
    STATS.messages.clear()
