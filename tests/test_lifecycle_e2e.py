"""The manager's lifecycle end to end, against every kind of cold tier (issue 22, item 6).

Each scenario is a plain training loop as a new user writes it: a ``CheckpointManager``,
quick saves, ``close()``. It runs against a local directory, moto's S3, the same S3 behind a
latency proxy (every request tens of ms late: a cold tier slower than the saves, which is
what exposed prune deleting checkpoints that never reached it) and fake-gcs-server
(tests/cold_tiers.py). What each one checks is what a user is promised:

* retention per tier keeps what each policy says and nothing un-migrated leaves the hot
  tier (a milestone is never lost in a burst of saves);
* the end of a run delivers its last checkpoint, or raises naming what it did not, in a
  bounded time, with the cold tier down; the next run resumes what was left pending;
* a resume falls back past a damaged newest checkpoint, which is set aside (quarantined):
  the step is saved again, retention counts only good checkpoints;
* a run whose hot tier is gone resumes from the cold tier and goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cold_tiers import Cold, cold_of

from tierstore import (
    CheckpointManager,
    Retention,
    TieredReader,
    TieredWriter,
    keep_every,
    keep_last,
    list_checkpoints,
)
from tierstore.errors import MigrationFailed
from tierstore.format import layout
from tierstore.lifecycle.quarantine import list_quarantined
from tierstore.lifecycle.retention import keep_all
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.status import migration_status
from tierstore.options import ManagerOptions
from tierstore.retry import RetryPolicy
from tierstore.tiers.tier import Store, Tier

FAST = MigrationOptions(
    chunk_size=1 << 16,
    poll_interval=0.02,
    commit_timeout=30,
    retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.05),
)


def state(step: int, kib: int = 256) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(kib * 256, generator=g), "step": torch.tensor(step)}


def blank(kib: int = 256) -> dict[str, Any]:
    return {"w": torch.zeros(kib * 256), "step": torch.tensor(-1)}


def steps(cold: Cold | Tier | str, hot: str | None = None) -> list[int]:
    if isinstance(cold, Cold):
        return [
            c.step
            for c in list_checkpoints(Store(cold=cold.url, cold_options=cold.direct_options))
            if c.step is not None
        ]
    return [c.step for c in list_checkpoints(hot if hot else str(cold)) if c.step is not None]


def manager(hot: str, cold: Cold, **options: Any) -> CheckpointManager:
    options.setdefault("migration", FAST)
    given = options.get("retention", Retention())
    options["retention"] = dataclasses.replace(given, hot_min_free=None)
    return CheckpointManager(Store(hot, cold.url, cold_options=cold.options), **options)


def every_cold_checkpoint_loads(cold: Cold) -> None:
    for step in steps(cold):
        target = blank()
        dcp.load(
            target,
            storage_reader=TieredReader(
                Store.of(None, cold.url, cold_options=cold.direct_options), step=step
            ),
        )
        assert torch.equal(target["w"], state(step)["w"]) and int(target["step"]) == step


TRAIN_STEP = 0.05  # seconds of "training" between saves: saves land during prune rounds


def test_a_burst_of_saves_keeps_every_policy_and_loses_no_milestone(any_cold: Cold, tmp_path: Path) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    run = manager(hot, cold, retention=Retention(hot=keep_last(2), cold=keep_last(3) | keep_every(4)))
    for step in range(1, 11):
        time.sleep(TRAIN_STEP)
        assert run.save(step, state(step))
    run.close()
    assert steps(cold) == [4, 8, 9, 10]  # the milestone included: it reached cold first
    assert steps(None, hot) == [9, 10]
    assert run.health().ok, run.health()
    every_cold_checkpoint_loads(cold)


def test_keep_last_one_hot_and_everything_cold(any_cold: Cold, tmp_path: Path) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    run = manager(hot, cold, retention=Retention(hot=keep_last(1), cold=keep_all()))
    for step in range(1, 13):
        time.sleep(TRAIN_STEP)
        run.save(step, state(step))
    run.close()
    assert steps(cold) == list(range(1, 13))  # none of 2-11 lost between the tiers
    assert steps(None, hot) == [12]


def test_the_end_of_a_run_delivers_its_last_checkpoint(any_cold: Cold, tmp_path: Path) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    run = manager(hot, cold)
    for step in (1, 2, 3):
        run.save(step, state(step))
    run.close()  # returns only once step 3 is committed in cold (or raises)
    assert steps(cold)[-1] == 3
    assert all(
        s.state.value == "committed"
        for s in migration_status(Store.of(hot, cold.url, cold_options=cold.direct_options))
    )


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def down(cold: Cold, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """The same cold tier as the product sees it while it is down: a closed port for the
    object stores, a path under a file for the directory."""
    if cold.kind == "local":
        blocker = tmp_path / "blocker"
        blocker.write_text("a file where the cold tier's directory should be")
        return str(blocker / "cold"), {}
    return cold.url, {**cold.options, "endpoint_url": f"http://127.0.0.1:{_closed_port()}"}


def test_cold_tier_down_close_returns_in_bounded_time_and_the_next_run_resumes(
    any_cold: Cold, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    url, options = down(cold, tmp_path)
    run = CheckpointManager(
        Store(hot, url, cold_options=options),
        retention=Retention(hot=keep_last(1), hot_min_free=None),
        migration=FAST,
        options=ManagerOptions(close_timeout=20),
    )
    for step in (1, 2, 3):
        run.save(step, state(step))
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="tierstore"), pytest.raises(MigrationFailed) as raised:
        run.close()
    took = time.monotonic() - started
    assert took < 20 + 10, f"close() took {took:.0f}s with the cold tier down"
    names = [layout.default_name(s) for s in (1, 2, 3)]
    assert list(raised.value.checkpoints) == names
    assert any(
        "did not reach the cold tier" in r.getMessage() and "tierstore migrate" in r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR
    )
    assert steps(None, hot) == [1, 2, 3]  # keep_last(1), but nothing un-migrated left hot
    if cold.kind == "local":
        return  # the blocked path stays blocked; the object stores come back below
    # The cold tier is back: the next run's manager finishes what the last one left.
    again = manager(hot, cold, retention=Retention(hot=keep_last(1)))
    again.close()
    assert steps(cold) == [1, 2, 3]
    assert steps(None, hot) == [3]


COLD_DOWN_RUN = """
import json, sys, time, torch
from tierstore import CheckpointManager, Retention, Store
from tierstore.errors import MigrationFailed
spec = json.loads(sys.argv[1])
run = CheckpointManager(
    Store(spec["hot"], spec["url"], cold_options=spec["options"]), retention=Retention(hot_min_free=None)
)
for step in (1, 2):
    run.save(step, {"w": torch.randn(256, 256)})
started = time.monotonic()
try:
    run.close()
    outcome = "returned"
except MigrationFailed as err:
    outcome = "MigrationFailed " + " ".join(err.checkpoints)
print(json.dumps({"outcome": outcome, "close_seconds": time.monotonic() - started}), flush=True)
"""


@pytest.mark.parametrize("kind", ["s3"])  # GCS down: test_cold_tier_down_close_returns_* (gcs)
def test_close_returns_in_seconds_with_the_cold_tier_down_and_default_retries(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The outside test's case: a closed port and the backend's own retry policy (minutes of
    backoff). close() asks the cold tier once, finds it down, and returns; the process ends
    with it (issue 22). In a process of its own: its retrying threads die with it."""
    cold = next(iter(cold_of(request, kind, tmp_path)))
    url, options = down(cold, tmp_path)
    options = {k: v for k, v in options.items() if k != "retry"}  # the default policy
    spec = {"hot": str(tmp_path / "hot"), "url": url, "options": options}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", COLD_DOWN_RUN, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "MigrationFailed step-0000000001 step-0000000002", result
    assert result["close_seconds"] < 10 + 8, result
    assert took < 60, f"the process took {took:.0f}s to end"
    assert "unreachable" in done.stderr and "tierstore migrate" in done.stderr


def test_a_killed_runs_pending_checkpoints_are_migrated_by_the_next_run(
    any_cold: Cold, tmp_path: Path
) -> None:
    """What a run killed before its migrations ran leaves: hot commits, nothing cold."""
    cold, hot = any_cold, str(tmp_path / "hot")
    for step in (1, 2):
        dcp.save(state(step), storage_writer=TieredWriter(hot, step=step))
    run = manager(hot, cold)
    run.save(3, state(3))
    run.close()
    assert steps(cold) == [1, 2, 3]


def test_a_damaged_newest_checkpoint_is_quarantined_and_saved_again(any_cold: Cold, tmp_path: Path) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    run = manager(hot, cold, retention=Retention(hot=keep_last(2), cold=keep_last(2)))
    for step in (8, 9, 10):
        run.save(step, state(step))
    run.close()
    # Step 10 damaged in both tiers (a same-size flip: found only by a verified read).
    hot_tier, cold_tier = Tier("hot", hot), cold.tier
    for tier in (hot_tier, cold_tier):
        manifest = tier.find_manifest(layout.default_name(10))
        assert manifest is not None
        key = tier.file_key(manifest.name, manifest.attempt, layout.data_file_name(0, 0))
        data = bytearray(tier.backend.read_bytes(key))
        data[len(data) // 2] ^= 1
        with tier.backend.open_write(key) as out:
            out.write(bytes(data))
    # The restarted job resumes from 9, trains step 10 again and saves it: no crash loop.
    restarted = manager(hot, cold, retention=Retention(hot=keep_last(2), cold=keep_last(2)))
    target = blank()
    assert restarted.load_latest(target) == 9
    assert torch.equal(target["w"], state(9)["w"])
    assert restarted.health().quarantined == (layout.default_name(10),)
    assert restarted.save(10, state(10))
    restarted.close()
    assert steps(None, hot) == [9, 10] and steps(cold) == [9, 10]  # good ones only: 8 went
    # And the next restart resumes from the good step 10.
    target = blank()
    again = manager(hot, cold)
    assert again.load_latest(target) == 10 and torch.equal(target["w"], state(10)["w"])
    again.close()
    # The damaged attempt is kept aside, named by status and ls, until removed by hand.
    store = Store(hot, cold.url, cold_options=cold.direct_options)
    aside = list_quarantined(store)
    assert {q.name for q in aside} == {layout.default_name(10)}
    assert {q.tier.split()[0] for q in aside} == {"hot", "cold"}


def test_a_run_whose_hot_tier_is_gone_resumes_from_cold_and_goes_on(any_cold: Cold, tmp_path: Path) -> None:
    cold, hot = any_cold, str(tmp_path / "hot")
    run = manager(hot, cold, retention=Retention(hot=keep_last(2), cold=keep_last(3)))
    for step in (1, 2, 3, 4):
        run.save(step, state(step))
    run.close()
    shutil.rmtree(hot)  # a new node: the hot tier is empty
    again = manager(hot, cold, retention=Retention(hot=keep_last(2), cold=keep_last(3)))
    target = blank()
    assert again.load_latest(target) == 4 and torch.equal(target["w"], state(4)["w"])
    for step in (5, 6):
        again.save(step, state(step))
    again.close()
    assert steps(cold) == [4, 5, 6] and steps(None, hot) == [5, 6]


@pytest.fixture
def slow_s3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    yield from cold_of(request, "s3-slow", tmp_path)


def test_a_stalled_cold_tier_never_blocks_a_save_and_close_is_bounded(slow_s3: Cold, tmp_path: Path) -> None:
    """The cold tier answers nothing (every request hangs): saves go on at hot speed."""
    cold, hot = slow_s3, str(tmp_path / "hot")
    run = manager(hot, cold, retention=Retention(hot=keep_last(1)), options=ManagerOptions(close_timeout=5))
    cold.down("stall")
    try:
        for step in (1, 2, 3):
            started = time.monotonic()
            run.save(step, state(step))
            assert time.monotonic() - started < 10
        started = time.monotonic()
        with pytest.raises(MigrationFailed):
            run.close()
        assert time.monotonic() - started < 5 + 40  # the deadline, and a lookup's bound
    finally:
        cold.up()
    assert steps(None, hot) == [1, 2, 3]
