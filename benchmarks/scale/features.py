"""Which of issue 15's features this tree has, probed without running them.

The replay measures whatever code is there; these probes only let the report say which
feature a number reflects. A probe that cannot tell says so, it never raises.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["features"]


def _source(module: str, name: str | None = None) -> str:
    target: Any = importlib.import_module(module)
    if name is not None:
        target = getattr(target, name)
    return inspect.getsource(target)


def _accepts(module: str, name: str, param: str) -> bool:
    target = getattr(importlib.import_module(module), name)
    return param in inspect.signature(target).parameters


def _options_have(field: str) -> bool:
    """Whether this tree's ``tierstore.options`` (absent before the options objects) names ``field``."""
    try:
        return field in _source("tierstore.options")
    except ImportError:
        return False


_PROBES: dict[str, tuple[str, Callable[[], bool]]] = {
    "range reads": (
        "TieredReader.bytes_read",
        lambda: "bytes_read" in _source("tierstore.dcp.reader", "TieredReader"),
    ),
    "two-level manifest": (
        "TieredWriter(manifest_part_ranks=) or WriterOptions(manifest_part_ranks=)",
        lambda: (
            _accepts("tierstore.dcp.writer", "TieredWriter", "manifest_part_ranks")
            or _options_have("manifest_part_ranks")
        ),
    ),
    "batched mark deletes": (
        "marks use Backend.delete_many",
        lambda: "delete_many" in _source("tierstore.tiers.marks"),
    ),
    "fresh uploads": (
        "Migrator.submit_rank(fresh=)",
        lambda: "fresh" in _source("tierstore.migration.migrator", "Migrator"),
    ),
    "resolve once": (
        "reader broadcasts the resolved checkpoint",
        lambda: "broadcast" in _source("tierstore.dcp.reader"),
    ),
    "batched prune": (
        "prune uses Backend.delete_many",
        lambda: "delete_many" in _source("tierstore.lifecycle.prune"),
    ),
    "batched gc": ("gc uses Backend.delete_many", lambda: "delete_many" in _source("tierstore.lifecycle.gc")),
}


def features() -> dict[str, str]:
    """Feature -> ``"landed"``, ``"not yet"`` or why the probe could not tell."""
    found = {}
    for feature, (what, probe) in _PROBES.items():
        try:
            found[feature] = "landed" if probe() else f"not yet ({what})"
        except Exception as err:  # a module mid-edit must not stop the report
            found[feature] = f"unknown ({type(err).__name__}: {err})"[:160]
    return found
