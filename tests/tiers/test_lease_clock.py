"""Lease liveness by the store's clock: a reader's (or pruner's) skewed clock changes nothing.

A local tier stamps object mtimes with this machine's kernel clock, so the store's time here is
real time; the reader's clock is skewed through ``leases.take(now=...)`` and the passage of
store time through ``os.utime`` on the lease object. A lease whose mtime lies far in the
future (a hostile or mistaken store) holds no longer than its ttl; one a little ahead, some
clock skew, still protects its load.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.tiers import leases
from tierstore.tiers.tier import Tier

HOUR = 3600.0
YEAR = 365 * 24 * HOUR


def store_with_two(tmp_path: Path) -> tuple[str, Tier, str]:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        dcp.save({"w": torch.full((16, 16), float(step))}, storage_writer=TieredWriter(hot, step=step))
    return hot, Tier("hot", hot), layout.default_name(1)


def age(hot: str, key: str, seconds: float) -> None:
    """Make the store say the lease was published ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(Path(hot, key), (then, then))


def to_future(hot: str, key: str, seconds: float) -> None:
    """Make the store say the lease was published ``seconds`` from now (a clock far ahead)."""
    age(hot, key, -seconds)


def test_a_reader_clock_hours_behind_still_protects_its_load(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, now=time.time() - 10 * HOUR)  # its "expiry" is already past
    assert held is not None
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deferred == (name,) and report.deleted == ()
    assert Path(hot, layout.checkpoint_prefix(name)).exists()  # data kept under the live load
    assert find_garbage(hot, grace=0) == []
    held.release()
    collect_garbage(hot, grace=0, dry_run=False)
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()


def test_a_reader_clock_far_ahead_does_not_block_pruning_forever(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, now=time.time() + 1000 * HOUR)  # "expires" in 6 weeks
    assert held is not None
    age(hot, held.key, leases.DEFAULT_TTL + HOUR)  # by the store's clock it is long expired
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deleted == (name,) and report.deferred == ()
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()
    report = collect_garbage(hot, grace=0, dry_run=False)
    assert [(g.key, g.reason) for g in report.garbage] == [(held.key, "expired lease")]
    assert [c.step for c in list_checkpoints(hot)] == [2]


def test_the_checkers_clock_does_not_matter_either(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, ttl=2 * HOUR)
    assert held is not None
    far = time.time() + 100 * HOUR
    assert leases.live_leases(tier, name, now=far) == [held.key]  # a pruner clock far ahead
    assert find_garbage(hot, grace=0, now=far) == []  # nor a GC's
    age(hot, held.key, 3 * HOUR)  # past its own ttl by the store's clock
    assert leases.live_leases(tier, name, now=time.time() - 100 * HOUR) == []


def test_leases_without_a_recorded_ttl_use_their_own_stamps(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    key = layout.lease_key(name, uuid.uuid4().hex)
    skewed = time.time() - 50 * HOUR  # a reader far behind, before leases recorded a ttl
    Path(hot, key).parent.mkdir(parents=True)
    Path(hot, key).write_text(json.dumps({"created": skewed, "expires": skewed + HOUR}))
    assert leases.live_leases(tier, name) == [key]  # an hour by the store's clock
    age(hot, key, 2 * HOUR)
    assert leases.live_leases(tier, name) == []


def test_store_time_is_the_stores_stamp_and_leaves_nothing(tmp_path: Path) -> None:
    hot, tier, _ = store_with_two(tmp_path)
    before = time.time()
    stamp = leases.store_time(tier)
    assert stamp is not None and before - 5 <= stamp <= time.time() + 5
    assert not [p for p in Path(hot, layout.LEASE_DIR).rglob("*") if p.is_file()]


def test_no_lease_outlives_max_ttl_and_hostile_ones_never_raise(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    forever = layout.lease_key(name, uuid.uuid4().hex)
    deep = layout.lease_key(name, uuid.uuid4().hex)
    Path(hot, forever).parent.mkdir(parents=True)
    Path(hot, forever).write_text(json.dumps({"created": 0, "expires": 1e308, "ttl": 1e308}))
    Path(hot, deep).write_text("[" * 30_000 + "]" * 30_000)  # under the size limit, too deep
    assert sorted(leases.live_leases(tier, name)) == sorted([forever, deep])
    age(hot, forever, leases.MAX_TTL + HOUR)
    age(hot, deep, leases.DEFAULT_TTL + HOUR)
    assert leases.live_leases(tier, name) == []
    assert {g.key for g in find_garbage(hot, grace=0)} == {forever, deep}


# -- a lease whose mtime lies far in the future (issue 22, item 5) ---------------------------


def test_a_lease_stamped_far_in_the_future_does_not_block_prune(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, ttl=60.0)
    assert held is not None
    to_future(hot, held.key, YEAR)
    assert leases.live_leases(tier, name) == []  # no lease holds more than its ttl
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deleted == (name,) and report.deferred == ()
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()


def test_a_lease_stamped_far_in_the_future_does_not_block_gc(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, ttl=60.0)
    assert held is not None
    [report] = prune(hot, hot_policy=keep_last(1))  # un-published; a live load keeps the data
    assert report.deferred == (name,)
    to_future(hot, held.key, YEAR)
    gc = collect_garbage(hot, grace=0, dry_run=False)
    assert (held.key, "expired lease") in [(g.key, g.reason) for g in gc.garbage]
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()


def test_a_lease_a_little_ahead_still_protects_its_load(tmp_path: Path) -> None:
    hot, tier, name = store_with_two(tmp_path)
    held = leases.take(tier, name, ttl=600.0)
    assert held is not None
    to_future(hot, held.key, 30.0)  # a stamp some clock skew ahead: still an honest lease
    assert leases.live_leases(tier, name) == [held.key]
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deferred == (name,)
