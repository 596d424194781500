"""Retention policies: pure functions from a tier's committed checkpoints to the names to keep.

Compose with ``|`` (keep what either keeps)::

    hot_policy = keep_last(2)
    cold_policy = keep_last(3) | keep_every(1000) | keep_steps(0)
    best_policy = keep_last(1) | keep_best("val_loss", 2)   # by the metrics saves recorded

A :class:`Retention` names a policy per tier, and how far a full hot tier may be pruned
beyond its policy; it is what :class:`~tierstore.CheckpointManager` takes.

A policy only says what it *wants*; :mod:`tierstore.lifecycle.prune` adds what must never be deleted
(the newest checkpoint of a tier, hot checkpoints whose cold commit is pending, checkpoints
in use) and deletes in the safe order. Policies never look at storage and never change.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from tierstore.errors import ConfigError
from tierstore.format.manifest import Checkpoint, checkpoint_order
from tierstore.format.manifest_format import check_metrics

__all__ = [
    "Checkpoint",
    "DEFAULT_COLD",
    "DEFAULT_HOT",
    "Policy",
    "Retention",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_none",
    "keep_steps",
    "keep_within",
    "within_run",
]


def _newest_first(checkpoints: Iterable[Checkpoint]) -> list[Checkpoint]:
    return sorted(checkpoints, key=checkpoint_order, reverse=True)


class Policy(abc.ABC):
    """Decides which checkpoints of one tier to keep; ``|`` keeps the union."""

    @abc.abstractmethod
    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        """Names to keep, a subset of ``checkpoints``' names; same input, same answer."""

    def __or__(self, other: Policy) -> Policy:
        return _Union((self, other))


@dataclass(frozen=True)
class _Union(Policy):
    parts: tuple[Policy, ...]

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        kept: frozenset[str] = frozenset()
        for part in self.parts:
            kept |= part.keep(checkpoints, now=now)
        return kept

    def __or__(self, other: Policy) -> Policy:
        return _Union((*self.parts, other))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.parts))


@dataclass(frozen=True)
class keep_last(Policy):
    """The ``n`` newest (by step, then creation time)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"keep_last needs n >= 0, got {self.n}")

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset(c.name for c in _newest_first(checkpoints)[: self.n])


@dataclass(frozen=True)
class keep_every(Policy):
    """Milestones: every checkpoint whose step is a multiple of ``k``."""

    k: int

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ValueError(f"keep_every needs k > 0, got {self.k}")

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset(c.name for c in checkpoints if c.step is not None and c.step % self.k == 0)


@dataclass(frozen=True, init=False)
class keep_steps(Policy):
    """These exact steps."""

    steps: frozenset[int]

    def __init__(self, *steps: int) -> None:
        object.__setattr__(self, "steps", frozenset(steps))

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset(c.name for c in checkpoints if c.step in self.steps)


@dataclass(frozen=True, init=False)
class keep_within(Policy):
    """Everything created in the last ``duration`` (seconds or a ``timedelta``)."""

    seconds: float

    def __init__(self, duration: float | timedelta) -> None:
        seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
        if seconds < 0:
            raise ValueError(f"keep_within needs a non-negative duration, got {duration!r}")
        object.__setattr__(self, "seconds", seconds)

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset(c.name for c in checkpoints if now - c.created <= self.seconds)


@dataclass(frozen=True)
class keep_best(Policy):
    """The ``k`` best by ``metric`` as their saves recorded it (``manager.save(...,
    metrics=)``): the lowest values with ``mode="min"``, the highest with ``"max"``; of equal
    values, the newer. A checkpoint without that metric is never among the best."""

    metric: str
    k: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        check_metrics({self.metric: 0.0}, source="keep_best", error=ValueError)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"keep_best needs k >= 0, got {self.k!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best needs mode 'min' or 'max', got {self.mode!r}")

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        sign = 1.0 if self.mode == "min" else -1.0
        # Checkpoint does not promise metrics: a checkpoint type without them has none.
        scored = [
            (sign * found[self.metric], c)
            for c in _newest_first(checkpoints)
            if self.metric in (found := getattr(c, "metrics", None) or {})
        ]
        scored.sort(key=lambda pair: pair[0])  # stable: equal values stay newest first
        return frozenset(c.name for _, c in scored[: self.k])


@dataclass(frozen=True)
class keep_all(Policy):
    """Never prune."""

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset(c.name for c in checkpoints)


@dataclass(frozen=True)
class keep_none(Policy):
    """Keep nothing the pruner's safety rules do not force it to keep."""

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        return frozenset()


@dataclass(frozen=True)
class within_run(Policy):
    """``policy`` over the checkpoints recorded for run ``run`` alone; every other
    checkpoint (another run's, or one no run was named for) is kept, and not counted.

    A named run's manager prunes with it: a store that also holds another run's checkpoints
    (reported at start) never loses one of them to this run's retention.
    """

    run: str
    policy: Policy

    def keep(self, checkpoints: Sequence[Checkpoint], *, now: float) -> frozenset[str]:
        # Checkpoint does not promise a run: a checkpoint type without one is no run's.
        mine = [c for c in checkpoints if getattr(c, "run", None) == self.run]
        others = frozenset(c.name for c in checkpoints) - {c.name for c in mine}
        return others | self.policy.keep(mine, now=now)


DEFAULT_HOT: Policy = keep_last(2)
# The durable tier deletes nothing the user did not ask it to (Orbax keeps everything by
# default too): a default that pruned it took milestones with it (issue 36, item 4).
DEFAULT_COLD: Policy = keep_all()


@dataclass(frozen=True)
class Retention:
    """What each tier keeps (:class:`~tierstore.CheckpointManager`'s ``retention=``).

    Args:
        hot: the hot tier's policy (default: the last 2, a rolling window).
        cold: the cold tier's policy (default: keep everything, :class:`keep_all`; the
            durable tier deletes only what a policy given here says, e.g.
            ``keep_last(3) | keep_every(1000)`` for recent history and milestones).
        hot_min_free: before each save, if the hot tier has less free space than this many
            bytes (``"auto"``, the default: 1.1x the newest checkpoint), prune it down to what
            the invariants force (the newest, and checkpoints not yet in cold) and warn;
            ``None``: never prune beyond ``hot``.

    Whatever a policy says, the pruner keeps each tier's newest checkpoint and every hot
    checkpoint the cold tier has not committed (:mod:`tierstore.lifecycle.prune`).
    """

    hot: Policy = DEFAULT_HOT
    cold: Policy = DEFAULT_COLD
    hot_min_free: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        for tier in ("hot", "cold"):
            policy = getattr(self, tier)
            if not isinstance(policy, Policy):
                raise ConfigError(
                    f"Retention({tier}=) takes a policy (keep_last(2), keep_every(1000), ... "
                    f"combined with |), got {type(policy).__name__}"
                )
        free = self.hot_min_free
        if not (free is None or free == "auto" or (type(free) is int and free >= 0)):
            raise ConfigError(
                f'Retention(hot_min_free=) takes a number of bytes >= 0, "auto" or None, got {free!r}'
            )
