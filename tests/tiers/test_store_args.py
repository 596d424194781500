"""Every operation on a store takes one ``Store`` (or a URL: a store of that one tier); the
forms that named its tiers one by one (``hot=``, ``cold=``, ``hot_options=``, ``cold_options=``,
``node_local=``), which no release published, are Python's own ``TypeError`` (issue 36).

Each test is parametrized over the operations. Real stores in local directories.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import state_for

from tierstore import (
    CheckpointNotFound,
    ConfigError,
    Store,
    TieredWriter,
    collect_garbage,
    list_checkpoints,
    migrate_pending,
    migration_status,
    prune,
    restore,
    verify_resume,
)
from tierstore.lifecycle.gc import find_garbage
from tierstore.lifecycle.quarantine import delete_quarantined, list_quarantined, restore_quarantined
from tierstore.lifecycle.scrub import verify_store
from tierstore.migration.restore import restore_checkpoint
from tierstore.migration.status import wait_for_migrations
from tierstore.resume.check import verify_checkpoint
from tierstore.tiers.catalog import latest_checkpoint

NOW = time.time() + 10.0  # one "now" for every GC scan, so two scans compare equal


def probe() -> Any:  # never built: the store the verify tests name holds no checkpoint
    raise AssertionError("the probe was built")


@dataclass(frozen=True)
class Op:
    """An operation, the arguments before its store, and the rest of a call to it."""

    name: str
    run: Callable[..., Any]
    lead: tuple[Any, ...] = ()
    rest: tuple[tuple[str, Any], ...] = ()
    keyword: bool = False  # the store is passed as store=, the old way as hot=
    empty: bool = False  # run against a store holding nothing (it would start processes)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The operation's result, or the error it raised (type and message)."""
        try:
            return outcome(self.run(*self.lead, *args, **dict(self.rest), **kwargs))
        except (CheckpointNotFound, ConfigError) as err:
            return type(err), str(err)

    def new(self, store: Store | str, **kwargs: Any) -> Any:
        return self.call(store=store, **kwargs) if self.keyword else self.call(store, **kwargs)


OPS = [
    Op("list_checkpoints", list_checkpoints),
    Op("latest_checkpoint", latest_checkpoint),
    Op("migration_status", migration_status),
    Op("migrate_pending", migrate_pending),
    Op("wait_for_migrations", wait_for_migrations, rest=(("timeout", 5.0),)),
    Op("restore", restore),
    Op("restore_checkpoint", restore_checkpoint),
    Op("prune", prune, rest=(("dry_run", True),)),
    Op("find_garbage", find_garbage, rest=(("grace", 0.0), ("now", NOW))),
    Op("collect_garbage", collect_garbage, rest=(("grace", 0.0), ("now", NOW))),
    Op("verify_store", verify_store),
    Op("verify_checkpoint", verify_checkpoint, lead=("tests:probe",), empty=True),
    Op("verify_resume", verify_resume, lead=(probe, {}), keyword=True, empty=True),
]
ONE_TIER = {
    "list_checkpoints",
    "latest_checkpoint",
    "prune",
    "find_garbage",
    "collect_garbage",
    "verify_store",
}
by_name = pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])


def outcome(value: Any) -> Any:
    """``value`` with what changes from one call to the next (migration lag, timestamps) left out."""
    if isinstance(value, list) and value and hasattr(value[0], "lag_seconds"):
        return [(s.name, s.attempt, s.state) for s in value]
    return value


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A hot and a cold tier holding steps 1 and 2, migrated (nothing below changes them)."""
    base = tmp_path_factory.mktemp("store_args")
    hot, cold = str(base / "hot"), str(base / "cold")
    for step in (1, 2):
        dcp.save(state_for(step), storage_writer=TieredWriter(Store(hot, cold), step=step))
    wait_for_migrations(Store(hot, cold), timeout=60)
    return hot, cold


@pytest.fixture
def tiers(op: Op, saved: tuple[str, str], tmp_path: Path) -> tuple[str, str]:
    return (str(tmp_path / "hot"), str(tmp_path / "cold")) if op.empty else saved


@by_name
def test_an_operation_takes_one_store(op: Op, tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    store = Store(hot, cold)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert op.new(store) == op.new(Store.of(hot, cold))
        if op.name in ONE_TIER:
            assert op.new(hot) == op.new(Store(hot))  # a URL is a store of that one tier


@by_name
def test_an_old_form_is_a_type_error(op: Op, tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    old: list[dict[str, Any]] = [
        {"hot": hot, "cold": cold},
        {"store": Store(hot), "cold": cold},
        {"store": Store(hot, cold), "cold_options": {"fsync": True}},
        {"store": Store(hot, cold), "hot_options": {"fsync": True}},
        {"store": Store(hot, cold), "node_local": True},
    ]
    for kwargs in old:
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            op.run(*op.lead, **dict(op.rest), **kwargs)


def test_every_exported_operation_taking_a_store_is_covered_here() -> None:
    import inspect

    import tierstore

    takes = {
        name
        for name in tierstore.__all__
        if inspect.isfunction(value := getattr(tierstore, name))
        and "store" in inspect.signature(value).parameters
    }
    assert takes <= {op.name for op in OPS} | {"export"}
    assert len(takes) >= 6


def test_the_quarantine_operations_take_a_store_or_a_url(saved: tuple[str, str]) -> None:
    hot, cold = saved
    assert list_quarantined(Store(hot, cold)) == list_quarantined(Store(hot)) + list_quarantined(
        Store(cold=cold)
    )
    assert list_quarantined(hot) == list_quarantined(Store(hot)) == []
    for op in (delete_quarantined, restore_quarantined):
        with pytest.raises(CheckpointNotFound, match="no quarantined checkpoint"):
            op(hot, "step-0000000001")
