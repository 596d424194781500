"""Every operation on a store takes one ``Store`` (or a URL: a store of that one tier), and the
forms that named its tiers one by one keep working for one release (issue 23 item 2).

Each test is parametrized over the operations, so an operation that loses
:func:`tierstore.tiers.store_arg.takes_store` fails here: its old forms raise ``TypeError``.
Real stores in local directories; what an operation returns the old way is compared with what
it returns the new way.
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
    keep_last,
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


def legacy(op: Op, *args: Any, **kwargs: Any) -> tuple[Any, warnings.WarningMessage]:
    """The old call's outcome and the one deprecation warning it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = op.call(*args, **kwargs)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    message = str(deprecations[0].message)
    assert message.startswith(f"tierstore.{op.name} is deprecated"), message
    assert "pass one Store" in message and "Store.of(" in message, message
    return result, deprecations[0]


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
def test_an_old_form_gives_the_same_result_with_one_warning(op: Op, tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    expected = op.new(Store(hot, cold))
    forms: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {"hot": hot, "cold": cold}),
        ((), {"hot": hot, "cold": cold, "hot_options": {"fsync": True}, "cold_options": {"fsync": True}}),
    ]
    if not op.keyword:
        forms += [
            ((hot, cold), {}),
            ((hot,), {"cold": cold}),
            ((hot, cold), {"cold_options": {"fsync": True}}),
        ]
    for args, kwargs in forms:
        result, warning = legacy(op, *args, **kwargs)
        assert result == expected, (args, kwargs)
        assert warning.filename == __file__  # it names the caller's line, not tierstore's


@by_name
def test_the_old_options_reach_the_tiers(op: Op, tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    expected = op.new(Store(hot, cold, cold_options={"no_such_option": 1}))
    assert "no_such_option" in repr(expected)  # raised, or (prune) reported
    result, _ = legacy(op, hot=hot, cold=cold, cold_options={"no_such_option": 1})
    assert result == expected


@by_name
def test_a_store_with_old_tier_arguments_is_refused(op: Op, tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    store = Store(hot)
    mixed: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {"store": store, "cold": cold}),
        ((), {"store": store, "cold_options": {"fsync": True}}),
        ((), {"store": store, "hot": hot}),
    ]
    if not op.keyword:
        mixed += [((store, cold), {})]
    for args, kwargs in mixed:
        with pytest.raises(ConfigError, match=f"tierstore.{op.name} got "):
            op.run(*op.lead, *args, **dict(op.rest), **kwargs)


NODE_LOCAL = [op for op in OPS if op.name in ("prune", "verify_resume")]


@pytest.fixture
def node(op: Op, tmp_path: Path) -> tuple[str, str]:
    """For prune: a node's hot root holding step 1 and a cold tier holding steps 1 and 2 (the
    second saved by another node), so that only a node-local prune drops step 1 (by the cold
    catalog, keep_last(1)); for verify_resume, a store holding nothing."""
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    if op.name == "prune":
        for root, step in ((hot, 1), (str(tmp_path / "other"), 2)):
            dcp.save(state_for(step), storage_writer=TieredWriter(Store(root, cold), step=step))
            wait_for_migrations(Store(root, cold), timeout=60)
    return hot, cold


@pytest.mark.parametrize("op", NODE_LOCAL, ids=[op.name for op in NODE_LOCAL])
def test_node_local_is_the_stores_and_the_old_keyword_still_says_it(op: Op, node: tuple[str, str]) -> None:
    hot, cold = node
    extra = {"hot_policy": keep_last(1)} if op.name == "prune" else {}
    expected = op.new(Store(hot, cold, node_local=True), **extra)
    assert expected != op.new(Store(hot, cold), **extra)  # node_local changes what the operation does
    assert legacy(op, hot=hot, cold=cold, node_local=True, **extra)[0] == expected
    assert legacy(op, store=Store(hot, cold), node_local=True, **extra)[0] == expected
    result, warning = legacy(op, store=Store(hot, cold, node_local=True), node_local=False, **extra)
    assert result == expected  # False was the old default: the store says
    assert "Store.of(store)" in str(warning.message)


def test_the_warning_says_what_to_write(saved: tuple[str, str]) -> None:
    hot, cold = saved
    warning = legacy(OPS[0], hot, cold, cold_options={"fsync": True})[1]
    assert "tierstore.list_checkpoints(Store.of(hot, cold, cold_options=...), ...)" in str(warning.message)


def test_every_exported_operation_taking_a_store_is_covered_here() -> None:
    import inspect

    import tierstore

    takes = {
        name
        for name in tierstore.__all__
        if inspect.isfunction(value := getattr(tierstore, name))
        and "store" in inspect.signature(value).parameters
    }
    # Operations newer than the old tier arguments take only a Store or a URL: nothing to fold.
    assert takes <= {op.name for op in OPS} | {"list_quarantined", "export"}
    assert len(takes) >= 8


def test_the_quarantine_operations_take_a_store_or_a_url(saved: tuple[str, str]) -> None:
    hot, cold = saved
    assert list_quarantined(Store(hot, cold)) == list_quarantined(Store(hot)) + list_quarantined(
        Store(cold=cold)
    )
    assert list_quarantined(hot) == list_quarantined(Store(hot)) == []
    for op in (delete_quarantined, restore_quarantined):
        with pytest.raises(CheckpointNotFound, match="no quarantined checkpoint"):
            op(hot, "step-0000000001")
