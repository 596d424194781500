"""Run locks a hostile or mistaken store holds (issue 22, item 5): ignored when a run starts,
and never the end of a live run's heartbeat. Real local directories."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from tierstore import StagingOptions
from tierstore.format import layout
from tierstore.manager import CheckpointManager
from tierstore.tiers import runlock
from tierstore.tiers.tier import Tier


def plant_run_lock(hot: Path, **fields: object) -> Path:
    """A run lock of another job, as ``runs/<run>/<beat>.json``, with ``fields`` overriding."""
    run = uuid.uuid4().hex
    body = {
        "run": run,
        "job": "planted",
        "host": "elsewhere",
        "pid": 4242,
        "pid_space": "",
        "ttl": 600.0,
        **fields,
    }
    path = hot / layout.run_lock_key(run, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))  # Infinity and NaN as Python's json writes them
    return path


HOSTILE_LOCKS = {
    "pid infinite": {"pid": float("inf")},
    "pid a huge float": {"pid": 1e300},
    "pid beyond any pid_t, on this machine": {"pid": 10**30, "pid_space": runlock._pid_space()},
    "pid a string": {"pid": "4242"},
    "pid a bool": {"pid": True},
    "pid negative": {"pid": -5},
    "job a list": {"job": ["a", "b"]},
    "ttl a string": {"ttl": "600"},
    "ttl nan": {"ttl": float("nan")},
}


@pytest.mark.parametrize("fields", list(HOSTILE_LOCKS.values()), ids=list(HOSTILE_LOCKS))
def test_a_hostile_run_lock_is_ignored_at_start(tmp_path: Path, fields: dict[str, object]) -> None:
    hot = tmp_path / "hot"
    plant_run_lock(hot, **fields)
    tier = Tier("hot", str(hot))
    assert runlock.live_runs(tier) == []  # ignored, never an exception
    manager = CheckpointManager(str(hot), staging=StagingOptions(async_save=False))
    manager.close()


def test_a_hostile_run_lock_planted_later_does_not_kill_the_heartbeat(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    tier = Tier("hot", str(hot))
    lock = runlock.acquire(tier, ttl=0.4)  # a beat every 0.1 s
    assert lock is not None and lock._thread is not None
    try:
        plant_run_lock(hot, pid=float("inf"))
        plant_run_lock(hot, pid=10**30, pid_space=runlock._pid_space())
        planted_at = lock.beat
        deadline = time.monotonic() + 20
        while lock.beat < planted_at + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock._thread.is_alive() and lock.beat >= planted_at + 5
        # Still beating: a beat of this run is in place (the newest, or the one before it
        # while the next is being published).
        assert list((hot / layout.run_lock_prefix(lock.info.run)).glob("*.json"))
    finally:
        lock.release()
