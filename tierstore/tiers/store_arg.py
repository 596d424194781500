"""One way to name a store in an operation, and the old calls that named its tiers one by one.

Every operation on a store (:func:`~tierstore.list_checkpoints`, :func:`~tierstore.prune`,
:func:`~tierstore.restore`, ...) takes one :class:`~tierstore.tiers.tier.Store` as ``store``,
or a URL, which is a store of that one tier. Before issue 23 each took ``hot, cold,
hot_options=, cold_options=`` (two of them ``node_local=`` too) and built the store itself;
:func:`takes_store` keeps those calls working for one release, building the store with
:meth:`Store.of` and warning once per call with what to write instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from tierstore.errors import ConfigError
from tierstore.options import warn_deprecated
from tierstore.tiers.tier import Store

__all__ = ["takes_store"]

P = ParamSpec("P")
R = TypeVar("R")

_TIERS = ("hot", "cold", "hot_options", "cold_options")
_ABSENT = object()


def takes_store(*, node_local: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Let an operation whose store parameter is ``store`` also be called the old way.

    The old forms: the cold URL as the argument after ``store`` (where ``store`` is
    positional), and the keywords ``hot=``, ``cold=``, ``hot_options=``, ``cold_options=``,
    and ``node_local=`` for an operation that took it. mypy sees only the new signature, so
    code type-checked against tierstore is told to move; plain Python is told at run time.
    """
    legacy = (*_TIERS, "node_local") if node_local else _TIERS

    def decorate(op: Callable[P, R]) -> Callable[P, R]:
        params = list(inspect.signature(op).parameters.values())
        at = next(i for i, p in enumerate(params) if p.name == "store")
        positional = params[at].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        lead = [p.name for p in params[:at] if p.kind is not inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(op)
        def call(*args: Any, **kwargs: Any) -> R:
            old = {k: kwargs.pop(k) for k in legacy if k in kwargs}
            used = [f"{k}=" for k in old]
            if positional and len(args) > at + 1 and "cold" not in old:
                old["cold"], args = args[at + 1], args[: at + 1] + args[at + 2 :]
                used.insert(0, "a cold URL after the store")
            if not old:
                return op(*args, **kwargs)
            given = args[at] if positional and len(args) > at else kwargs.pop("store", _ABSENT)
            store = _legacy_store(op.__name__, given, old)
            warn_deprecated(op.__name__, _message(op.__name__, lead, positional, used, old), stacklevel=2)
            if positional and len(args) > at:
                args = (*args[:at], store, *args[at + 1 :])
            else:
                kwargs["store"] = store
            return op(*args, **kwargs)

        return cast(Callable[P, R], call)

    return decorate


def _legacy_store(name: str, given: Any, old: dict[str, Any]) -> Store:
    hot = old.get("hot", _ABSENT)
    if given is not _ABSENT and hot is not _ABSENT:
        raise ConfigError(f"tierstore.{name} got both store and hot=: pass one Store as store")
    first = given if hot is _ABSENT else hot
    first = None if first is _ABSENT else first
    if isinstance(first, Store) and (
        old.get("cold") is not None or old.get("hot_options") or old.get("cold_options")
    ):
        raise ConfigError(
            f"tierstore.{name} got a Store and cold=/hot_options=/cold_options= as well: a Store "
            "already names its tiers and their options; pass Store.of(hot, cold, hot_options=..., "
            "cold_options=...) alone"
        )
    return Store.of(
        first,
        old.get("cold"),
        hot_options=old.get("hot_options"),
        cold_options=old.get("cold_options"),
        node_local=old.get("node_local") or None,  # False was the old default: as the store says
    )


def _message(name: str, lead: list[str], positional: bool, used: list[str], old: dict[str, Any]) -> str:
    parts = ["hot" if old.keys() - {"node_local"} else "store"]
    parts += ["cold"] if "cold" in old else []
    parts += [f"{k}=..." for k in ("hot_options", "cold_options") if k in old]
    parts += ["node_local=True"] if old.get("node_local") else []  # False: as the store says
    of = f"Store.of({', '.join(parts)})"
    call = ", ".join([*lead, of if positional else f"store={of}", "..."])
    return (
        f" with {', '.join(used)}: pass one Store, tierstore.{name}({call}) (the old form goes "
        "in the next release)"
    )
