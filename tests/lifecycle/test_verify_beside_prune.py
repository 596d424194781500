"""`tierstore verify` beside a running job (issue 34, item 4): a checkpoint its prune
un-published between verify's listing and its reads is not damage; a file missing from a
checkpoint still committed is. Verify is held at ``verify.after_listing`` while the prune runs
(deterministic), for the hot tier and for every kind of cold tier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from cold_tiers import Cold
from helpers import state_for

from tierstore import TieredWriter
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.lifecycle.scrub import FileCheck, verify_store
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.status import migrate_pending
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.storage.checksum import crc32c_update
from tierstore.testing.faults import armed_env
from tierstore.tiers.tier import Store, Tier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

POINT = "verify.after_listing"
FAST = MigrationOptions(poll_interval=0.01, commit_timeout=5, retry=RetryPolicy(attempts=2, initial=0.001))


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "gate"
    directory.mkdir()
    monkeypatch.setenv(faults.BLOCK_DIR_ENV, str(directory))
    monkeypatch.setenv(faults.BLOCK_TIMEOUT_ENV, "60")
    yield directory
    faults.disarm()


def verify_held(gate: Path, store: Store, *, hit: int, meanwhile: Callable[[], Any]) -> list[FileCheck]:
    """``verify_store(store)`` held after its ``hit``-th tier listing while ``meanwhile()`` runs."""
    faults.arm(POINT, "block", hit=hit)
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(_outcome(lambda: verify_store(store))))
    thread.start()
    try:
        wait_reached(gate, thread.is_alive)
        meanwhile()
    finally:
        (gate / f"{POINT}.release").touch()
        thread.join(60)
    faults.disarm()
    result = found[0]
    if isinstance(result, BaseException):
        raise result
    return list(result)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as err:  # handed to the test's thread
        return err


def wait_reached(gate: Path, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not list(gate.glob(f"{POINT}.*.reached")):
        assert alive() and time.monotonic() < deadline, "verify never reached its gate"
        time.sleep(0.005)


def three_migrated(hot: str, cold: Cold) -> Store:
    """Steps 1-3 saved and committed in both tiers."""
    for step in (1, 2, 3):
        dcp.save(state_for(step), storage_writer=TieredWriter(hot, step=step))
    store = cold.store(hot)
    assert all(s.state.value == "committed" for s in migrate_pending(store, config=FAST))
    return store


def prune_to_one(store: Store) -> None:
    prune(store, hot_policy=keep_last(1), cold_policy=keep_last(1))


def by_checkpoint(checks: list[FileCheck], role: str) -> dict[str, list[FileCheck]]:
    found: dict[str, list[FileCheck]] = {}
    for c in checks:
        if c.tier.startswith(role + " "):
            found.setdefault(c.checkpoint, []).append(c)
    return found


@pytest.mark.parametrize(("role", "hit"), [("hot", 1), ("cold", 2)])
def test_checkpoints_pruned_between_the_listing_and_the_reads_are_not_damage(
    any_cold: Cold, tmp_path: Path, gate: Path, role: str, hit: int
) -> None:
    store = three_migrated(str(tmp_path / "hot"), any_cold)
    # A file of the checkpoint the prune keeps goes missing by hand: that one is damage.
    kept = any_cold.tier if role == "cold" else Tier("hot", str(tmp_path / "hot"))
    newest = kept.find_manifest(layout.default_name(3))
    assert newest is not None
    lost = next(f for f in newest.files if f.path != layout.METADATA_FILE)
    checks = verify_held(
        gate,
        store,
        hit=hit,
        meanwhile=lambda: (
            prune_to_one(store),
            kept.backend.delete(kept.file_key(newest.name, newest.attempt, lost.path)),
        ),
    )
    seen = by_checkpoint(checks, role)
    assert sorted(seen) == [layout.default_name(s) for s in (1, 2, 3)]  # what it listed
    for step in (1, 2):
        files = seen[layout.default_name(step)]
        assert all(c.ok and c.pruned for c in files), files  # every file gone: not damage
        assert all("un-published while verify read it" in (c.problem or "") for c in files)
    damaged = [c for c in checks if not c.ok]
    assert [(c.checkpoint, c.file, c.pruned) for c in damaged] == [(newest.name, lost.path, False)]
    assert "no such object" in (damaged[0].problem or "")  # missing, and still committed


def two_level(hot: Tier) -> Manifest:
    """A committed checkpoint of four ranks whose manifest is a root and two parts."""
    name, attempt = layout.default_name(1), layout.new_attempt(grouped=True)
    files = []
    for rank, path in [(r, layout.data_file_name(r, 0)) for r in range(4)] + [(0, layout.METADATA_FILE)]:
        data = f"{path} of rank {rank}".encode()
        with hot.backend.open_write(hot.file_key(name, attempt, path)) as out:
            out.write(data)
        files.append(FileEntry(path, len(data), crc32c_update(0, data), rank))
    manifest = Manifest(
        name=name,
        step=1,
        attempt=attempt,
        world_size=4,
        created=time.time(),
        files=sorted(files, key=lambda f: (f.rank, f.path)),
        producer="test",
        part_ranks=2,
    )
    hot.publish_manifest(manifest)
    return manifest


def test_a_pruned_two_level_manifest_whose_part_is_gone_is_not_damage(tmp_path: Path, gate: Path) -> None:
    hot = Tier("hot", str(tmp_path / "hot"))
    manifest = two_level(hot)
    assert manifest.parts  # a root and its parts

    def prune_by_hand() -> None:  # what prune_tier does: un-publish first, then the data
        assert hot.unpublish(manifest)
        for info in list(hot.backend.list(layout.attempt_prefix(manifest.name, manifest.attempt))):
            hot.backend.delete(info.key)

    checks = verify_held(gate, Store.of(hot.url), hit=1, meanwhile=prune_by_hand)
    assert [(c.file, c.ok, c.pruned) for c in checks] == [("<manifest>", True, True)]


def test_the_cli_beside_a_prune_exits_0_and_says_what_was_pruned(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    store = three_migrated(hot, Cold("local", cold, {}, {}))
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, **armed_env(f"{POINT}=block", block_dir=gate)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "verify", "--hot", hot, "--cold", cold],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_reached(gate, lambda: proc.poll() is None)
        prune_to_one(store)
    finally:
        (gate / f"{POINT}.release").touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    assert "DAMAGED" not in out
    for step in (1, 2):
        assert f"PRUNED   hot {hot}  {layout.default_name(step)}: un-published while verify read it" in out
    # hot: 2 files of step 3 checked, 4 of the pruned ones not; cold (listed after): step 3's 2.
    assert (
        out.strip().splitlines()[-1]
        == "verified 4 files: 4 ok, 0 damaged; 4 files of pruned checkpoints not checked"
    )
