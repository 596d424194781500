"""The arguments :class:`~tierstore.CheckpointManager` no longer takes, each refused with a
``TypeError`` naming the form that replaced it (tierstore never released them: no
deprecation period), and the options objects it takes, checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from tierstore.errors import ConfigError

__all__ = ["refuse_removed", "given", "REPLACED"]

_T = TypeVar("_T")

_STORE = "CheckpointManager(Store(hot, cold, {}=...), ...): tier options live on the Store"

# The old keyword -> what to write instead.
REPLACED = {
    "hot_options": _STORE.format("hot_options"),
    "cold_options": _STORE.format("cold_options"),
    "node_local": _STORE.format("node_local"),
    "path": "CheckpointManager(hot, cold, ...): the hot tier is the first argument",
    "hot_policy": "retention=Retention(hot=...)",
    "cold_policy": "retention=Retention(cold=...)",
    "hot_min_free": "retention=Retention(hot_min_free=...)",
    "async_save": "staging=StagingOptions(async_save=...)",
    "async_mode": "staging=StagingOptions(mode=...)",
    "overlap_staging": "staging=StagingOptions(overlap=...)",
    "writer_options": "writer=WriterOptions(...)",
    "close_timeout": "options=ManagerOptions(close_timeout=...)",
    "process_group": "options=ManagerOptions(process_group=...)",
}


def refuse_removed(given: Mapping[str, Any], owner: str = "CheckpointManager") -> None:
    """Raise the ``TypeError`` for the first keyword of ``given``: for an old one, naming
    its new form; for any other, as Python's own would."""
    if not given:
        return
    name = sorted(given)[0]
    if name in REPLACED:
        raise TypeError(f"{owner}() no longer takes {name}=: pass {REPLACED[name]}")
    raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")


def given(param: str, value: Any, cls: type[_T]) -> _T:
    """``CheckpointManager(param=value)``: an instance of ``cls``, or ``cls()`` for ``None``."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"CheckpointManager({param}=) takes a {cls.__name__}, got {type(value).__name__}")
    return value
