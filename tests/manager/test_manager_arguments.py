"""CheckpointManager's one way in (issue 36, items 1 and 2): the store first (URLs or paths, or
a Store where tier options or node-local tiers are needed), at most 10 parameters, and every
keyword of an older form refused with a TypeError naming the form that replaced it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from tierstore import CheckpointManager, StagingOptions, Store
from tierstore.errors import ConfigError
from tierstore.manager.removed import REPLACED
from tierstore.options import ManagerOptions

SYNC = StagingOptions(async_save=False)


def test_the_constructor_takes_at_most_ten_named_parameters() -> None:
    named = [
        p
        for p in inspect.signature(CheckpointManager).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert len(named) <= 10, [p.name for p in named]
    assert not set(REPLACED) & {p.name for p in named}


@pytest.mark.parametrize("old", sorted(REPLACED))
def test_an_old_keyword_is_a_type_error_naming_its_new_form(tmp_path: Path, old: str) -> None:
    with pytest.raises(TypeError, match=f"no longer takes {old}=: pass {REPLACED[old].split('(')[0]}"):
        CheckpointManager(str(tmp_path / "hot"), **{old: None})
    assert not (tmp_path / "hot").exists()


def test_an_unknown_keyword_is_pythons_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'save_evry'"):
        CheckpointManager(str(tmp_path / "hot"), save_evry=1)


@pytest.mark.parametrize(
    "given, message",
    [
        ({"staging": "fresh"}, r"staging=\) takes a StagingOptions, got str"),
        ({"options": 60}, r"options=\) takes a ManagerOptions, got int"),
    ],
)
def test_an_options_object_of_another_kind_is_a_config_error(
    tmp_path: Path, given: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointManager(str(tmp_path / "hot"), **given)


def test_a_close_timeout_that_is_no_number_of_seconds_is_a_config_error() -> None:
    for bad in (-1, float("inf"), "60", True):
        with pytest.raises(ConfigError, match="close_timeout must be a number of seconds >= 0"):
            ManagerOptions(close_timeout=bad)


def test_tier_options_and_node_local_tiers_come_with_a_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "hot", tmp_path / "cold", node_local=True)
    options = ManagerOptions(close_timeout=7)
    with CheckpointManager(store, staging=SYNC, options=options, preemption=False) as manager:
        assert manager.store is store and manager.node_local
        assert manager.close_timeout == 7.0
    with pytest.raises(ConfigError, match="pass either a Store or tier URLs"):
        CheckpointManager(store, str(tmp_path / "other"))
