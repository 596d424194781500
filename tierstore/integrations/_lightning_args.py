"""What :class:`~tierstore.integrations.lightning.TierstoreCheckpoint` checks of its arguments
when it is built, and of the strategy when the trainer sets it up; and the retention policy
that keeps what ``ModelCheckpoint`` keeps."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import Strategy

from tierstore.errors import ConfigError
from tierstore.lifecycle.retention import Policy, Retention, keep_all, keep_best, keep_last
from tierstore.manager import CheckpointManager
from tierstore.manager.removed import REPLACED

__all__ = ["policy_for"]


def _check_manager_options(options: Mapping[str, Any]) -> None:
    """Refuse, when the callback is built, a ``manager_options`` key that
    :class:`~tierstore.CheckpointManager` does not take: the manager itself is built in
    ``setup()``, once the trainer runs, and a typo must not wait for that."""
    taken = set(inspect.signature(CheckpointManager).parameters) - {"hot", "cold", "retention", "removed"}
    unknown = sorted(set(options) - taken)
    if not unknown:
        return
    if unknown[0] in REPLACED:
        raise TypeError(
            f"TierstoreCheckpoint(manager_options=) got {unknown[0]!r}, which CheckpointManager "
            f"no longer takes: pass {REPLACED[unknown[0]]} (a Store goes as the callback's hot)"
        )
    raise TypeError(
        f"TierstoreCheckpoint(manager_options=) got {unknown[0]!r}, which CheckpointManager "
        f"does not take (it takes {', '.join(sorted(taken))}); retention is the callback's "
        "own argument"
    )


def _retention(given: Retention | None, policy: Policy) -> Retention:
    """``given``, or both tiers keeping ``policy``."""
    if given is not None and not isinstance(given, Retention):
        raise ConfigError(f"TierstoreCheckpoint(retention=) takes a Retention, got {type(given).__name__}")
    return given or Retention(hot=policy, cold=policy)


def policy_for(monitor: str | None, save_top_k: int, mode: str, save_last: object) -> Policy:
    """The retention policy that keeps what ``ModelCheckpoint`` with these arguments keeps."""
    if save_top_k == -1:
        return keep_all()
    if monitor is not None:
        best: Policy = keep_best(monitor, save_top_k, "max" if mode == "max" else "min")
    else:
        best = keep_last(save_top_k)
    return best | keep_last(1) if save_last else best


# ModelCheckpoint's arguments that only shape the name of a .ckpt file, which a tierstore
# checkpoint does not have: given a value other than the default, each is named in a warning
# when the callback is built (every other argument is honoured: docs/integrations.md).
_UNUSED = {
    "dirpath": (None, "checkpoints go to the store's tiers (hot=, cold=)"),
    "filename": (
        None,
        "a checkpoint is named by its step (best_model_path is TierstoreCheckpoint.step_path(N))",
    ),
    "auto_insert_metric_name": (
        True,
        "there is no file name to insert it in; `tierstore ls` shows the metric",
    ),
    "enable_version_counter": (True, "a step is saved once: committed checkpoints are never overwritten"),
}


def _warn_unused(options: Mapping[str, Any]) -> None:
    for argument, (default, why) in _UNUSED.items():
        if argument in options and options[argument] != default:
            warnings.warn(
                f"TierstoreCheckpoint ignores ModelCheckpoint's {argument}={options[argument]!r}: {why}",
                UserWarning,
                stacklevel=3,
            )


def _check_strategy(strategy: Strategy) -> None:
    """Refuse strategies whose checkpoint dict is not one shard per rank."""
    name = type(strategy).__name__
    if name == "DeepSpeedStrategy":
        raise ConfigError(
            "TierstoreCheckpoint does not support DeepSpeedStrategy (it writes "
            "its own checkpoint format); use ModelParallelStrategy or DDP"
        )
    if getattr(strategy, "_state_dict_type", "sharded") != "sharded" or not getattr(
        strategy, "_save_distributed_checkpoint", True
    ):
        raise ConfigError(
            f"TierstoreCheckpoint needs {name} to save sharded state from every "
            "rank: pass state_dict_type='sharded' (FSDPStrategy) or "
            "save_distributed_checkpoint=True (ModelParallelStrategy)"
        )
