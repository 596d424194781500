"""Progress that tells the truth (issue 26, item 5): ``migrate``'s and ``restore``'s byte
counts never run ahead of what the destination holds, sampled from the destination itself
each time the callback fires, on a slow cold tier (S3 behind the latency proxy); and an
interrupted ``tierstore migrate`` counts as done only what ``tierstore status`` shows
committed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cold_tiers import Cold, cold_of
from helpers import save

from tierstore.errors import ObjectNotFound
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.migration.restore import restore_checkpoint
from tierstore.migration.status import migrate_pending
from tierstore.testing.faults import armed_env
from tierstore.tiers.tier import Store, Tier

BIG = (512, 1024)  # 2 MiB of data a checkpoint
SMALL_CHUNKS = MigrationOptions(chunk_size=64 << 10)  # many chunks a file


@pytest.fixture
def slow_cold(request: pytest.FixtureRequest, tmp_path: Path):
    yield from cold_of(request, "s3-slow", tmp_path)


def held(tier: Tier, manifest: Manifest) -> int:
    """The bytes of ``manifest``'s files that ``tier`` holds whole, as it lists them now."""
    total = 0
    for entry in manifest.files:
        try:
            info = tier.backend.stat(tier.file_key(manifest.name, manifest.attempt, entry.path))
        except ObjectNotFound:
            continue
        total += entry.size if info.size == entry.size else 0
    return total


def test_migrate_progress_never_runs_ahead_of_the_bucket(tmp_path: Path, slow_cold: Cold) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        save(hot, step, shape=BIG)
    manifests = {m.name: m for m in Store(hot).hot.manifests()}  # type: ignore[union-attr]
    samples: list[tuple[str, int, int, int]] = []

    def progress(name: str, done: int, total: int) -> None:
        samples.append((name, done, total, held(slow_cold.tier, manifests[name])))

    results = migrate_pending(slow_cold.store(hot), config=SMALL_CHUNKS, progress=progress)
    assert [r.state for r in results] == [MigrationState.COMMITTED] * 2
    assert all(done <= there for _, done, _, there in samples), samples
    for name, manifest in manifests.items():
        mine = [s for s in samples if s[0] == name]
        assert mine[0][1] == 0 and mine[-1][1] == mine[-1][2] == manifest.total_size, mine
        # Bytes move as files are stored, not all at once at the start.
        assert len({done for _, done, _, _ in mine}) >= len(manifest.files), mine


def test_restore_progress_never_runs_ahead_of_the_hot_tier(tmp_path: Path, slow_cold: Cold) -> None:
    source, hot = str(tmp_path / "source"), str(tmp_path / "hot")
    save(source, 1, shape=BIG)
    migrate_pending(slow_cold.store(source))
    samples: list[tuple[int, int]] = []
    target = slow_cold.store(hot)
    manifest = next(iter(slow_cold.tier.manifests()))
    assert target.hot is not None

    def progress(name: str, done: int, total: int) -> None:
        samples.append((done, held(target.hot, manifest)))  # type: ignore[arg-type]

    restore_checkpoint(target, config=SMALL_CHUNKS, progress=progress)
    assert samples[-1][0] == manifest.total_size and len(samples) >= 2
    assert all(done <= there for done, there in samples), samples


def test_ctrl_c_mid_migrate_summary_matches_status(tmp_path: Path, slow_cold: Cold) -> None:
    """Held after step 2's files are all stored, before its upload mark and cold commit: its
    bar says 100%, yet it is not committed, and the summary says so as status does."""
    hot, gates = str(tmp_path / "hot"), tmp_path / "gates"
    gates.mkdir()
    names = [layout.default_name(s) for s in (1, 2)]
    for step in (1, 2):
        save(hot, step, shape=BIG)
    tiers = ["--hot", hot, "--cold", slow_cold.url]
    tiers += [f"--cold-option={k}={v}" for k, v in slow_cold.options.items() if k != "retry"]
    env = {**os.environ, **armed_env("migrator.before_mark_publish@2=block", block_dir=gates)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "migrate", *tiers],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    while not list(gates.glob("migrator.before_mark_publish.*.reached")) and proc.poll() is None:
        time.sleep(0.05)  # polls the gate file; no time is asserted
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert re.search(rf"^{names[1]}: 100% ", err, re.M), err  # every byte of it stored
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("tierstore migrate: interrupted: uploaded "), summary
    status = subprocess.run(
        [sys.executable, "-m", "tierstore", "status", *tiers, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    states = {s["name"]: s["state"] for s in json.loads(status.stdout)}
    assert states == {names[0]: "committed", names[1]: "pending"}, status.stdout
    committed = [n for n, state in states.items() if state == "committed"]
    assert f"{len(committed)} checkpoint(s) committed there" in summary, summary
    assert f"({names[1]} not committed)" in summary, summary
    assert "run the same `tierstore migrate` again to finish" in summary
