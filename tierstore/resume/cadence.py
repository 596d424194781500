"""Checkpoint cadence from the failure rate: how often to save so expected lost work is smallest.

A job of ``nodes`` nodes, each failing on average every ``mtbf_node`` seconds, fails every
``MTBF_job = mtbf_node / nodes`` seconds. Each save stalls training ``stall`` seconds. Saving
every ``tau`` seconds of work costs ``stall / tau`` of the time in stalls, and a failure loses
on average half a segment, ``(tau + stall) / 2``, plus the ``restart`` time. Young (1974)
minimises the sum: ``tau = sqrt(2 * stall * MTBF_job)``. Daly (2006) adds higher-order terms
that matter once the stall is no longer small next to the MTBF::

    tau = sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d      for d < 2M
    tau = M                                                           otherwise

::

    plan = optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=15.0)
    plan.interval                   # ~1090 s: save about every 18 minutes
    manager = CheckpointManager(hot, cold, save_every=TimeCadence(plan.interval))

:class:`TimeCadence` is a ``step -> bool`` the manager takes as ``save_every``: it says yes when
the interval has elapsed since the last yes. Every rank must decide alike, or one rank enters
a save the others skip and the job hangs: when ``torch.distributed`` is initialised the ranks
agree through one tiny all-reduce per check (a save starts once every rank's clock says so).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tierstore._dist import initialized as _dist_ready
from tierstore.errors import ConfigError

__all__ = ["CadencePlan", "optimal_interval", "expected_waste", "TimeCadence"]

log = logging.getLogger(__name__)

METHODS = ("young", "daly")


@dataclass(frozen=True)
class CadencePlan:
    """A checkpoint interval and what it costs; every time is in seconds.

    Attributes:
        interval: seconds of training between the starts of two saves.
        mtbf_job: mean time between failures of the whole job (``mtbf_node / nodes``).
        stall: seconds training is blocked per save.
        restart: seconds from a failure to training again (relaunch and load).
        lost_per_failure: expected work lost per failure, ``(interval + stall) / 2 + restart``.
        stall_overhead: fraction of time spent stalled by saves, ``stall / interval``.
        failure_overhead: fraction of time lost to failures, ``lost_per_failure / mtbf_job``.
        waste: ``stall_overhead + failure_overhead`` (first order; small when both are).
        method: ``"young"`` or ``"daly"``.
    """

    interval: float
    mtbf_job: float
    stall: float
    restart: float
    lost_per_failure: float
    stall_overhead: float
    failure_overhead: float
    waste: float
    method: str

    def describe(self) -> str:
        return (
            f"save every {_duration(self.interval)} (job MTBF {_duration(self.mtbf_job)}, "
            f"stall {self.stall:.3g} s, {self.method}): expect {_duration(self.lost_per_failure)} "
            f"lost per failure, {self.stall_overhead:.2%} of time in save stalls, "
            f"{self.failure_overhead:.2%} lost to failures"
        )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a positive number, got {value!r}")


def young_interval(stall: float, mtbf_job: float) -> float:
    return math.sqrt(2.0 * stall * mtbf_job)


def daly_interval(stall: float, mtbf_job: float) -> float:
    if stall >= 2.0 * mtbf_job:
        return mtbf_job  # saving costs more than it protects: once per MTBF is Daly's bound
    ratio = stall / (2.0 * mtbf_job)
    return math.sqrt(2.0 * stall * mtbf_job) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall


def expected_waste(
    interval: float, *, mtbf_job: float, stall: float, restart: float = 0.0, method: str = "given"
) -> CadencePlan:
    """What saving every ``interval`` seconds costs, for comparing any interval to the optimum."""
    _check_positive(interval=interval, mtbf_job=mtbf_job, stall=stall)
    lost = (interval + stall) / 2.0 + restart
    stall_overhead = stall / interval
    failure_overhead = lost / mtbf_job
    return CadencePlan(
        interval,
        mtbf_job,
        stall,
        restart,
        lost,
        stall_overhead,
        failure_overhead,
        stall_overhead + failure_overhead,
        method,
    )


def optimal_interval(
    *, nodes: int, mtbf_node: float, stall: float, restart: float = 0.0, method: str = "daly"
) -> CadencePlan:
    """The interval that minimises expected lost work for ``nodes`` nodes of ``mtbf_node`` MTBF.

    ``stall`` is the measured blocking time of one save (``max(manager.stalls.values())``);
    with ``dcp.async_save`` that is the staging copy, not the whole write.
    """
    if nodes < 1:
        raise ConfigError(f"nodes must be at least 1, got {nodes}")
    if method not in METHODS:
        raise ConfigError(f"method must be one of {METHODS}, got {method!r}")
    _check_positive(mtbf_node=mtbf_node, stall=stall)
    mtbf_job = mtbf_node / nodes
    interval = (daly_interval if method == "daly" else young_interval)(stall, mtbf_job)
    return expected_waste(interval, mtbf_job=mtbf_job, stall=stall, restart=restart, method=method)


class TimeCadence:
    """``step -> bool``: save when ``interval`` seconds have passed since the last save.

    Args:
        interval: seconds between saves (e.g. ``optimal_interval(...).interval``).
        clock: monotonic seconds; injectable so tests never sleep.
        check_every: only look at the clock every this many steps (each look is one
            all-reduce when distributed).
        group: process group the ranks agree on; default the world. Call from the training
            thread, where training's own collectives run in program order.
        distributed: agree across ranks; default when ``torch.distributed`` is initialised.

    The timer starts at construction (or :meth:`reset`). :meth:`update` re-plans the interval
    from a measured stall, e.g. after the first saves::

        cadence.update(stall=max(manager.stalls.values()))
    """

    def __init__(
        self,
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        check_every: int = 1,
        group: Any = None,
        distributed: bool | None = None,
        plan: Mapping[str, Any] | None = None,
    ) -> None:
        _check_positive(interval=interval)
        if check_every < 1:
            raise ConfigError(f"check_every must be at least 1, got {check_every}")
        self.interval = float(interval)
        self.clock = clock
        self.check_every = check_every
        self.group = group
        self._distributed = distributed
        self._plan = dict(plan or {})  # nodes, mtbf_node, restart, method: for update()
        self.last = clock()
        self.saves = 0

    @classmethod
    def from_failure_rate(
        cls,
        *,
        nodes: int,
        mtbf_node: float,
        stall: float,
        restart: float = 0.0,
        method: str = "daly",
        **options: Any,
    ) -> TimeCadence:
        """A cadence at the optimal interval for this job's failure rate and save stall."""
        plan = optimal_interval(nodes=nodes, mtbf_node=mtbf_node, stall=stall, restart=restart, method=method)
        log.info("checkpoint cadence: %s", plan.describe())
        return cls(
            plan.interval,
            plan={"nodes": nodes, "mtbf_node": mtbf_node, "restart": restart, "method": method},
            **options,
        )

    def update(self, *, stall: float | Iterable[float]) -> float:
        """Re-plan from a measured stall (a number, or several: their maximum); the new interval."""
        if not self._plan:
            raise ConfigError("update() needs a cadence made by TimeCadence.from_failure_rate")
        worst = stall if isinstance(stall, (int, float)) else max(stall, default=0.0)
        self.interval = optimal_interval(stall=max(float(worst), 1e-3), **self._plan).interval
        return self.interval

    def reset(self) -> None:
        self.last = self.clock()

    def __repr__(self) -> str:
        planned = "".join(f", {key}={value!r}" for key, value in self._plan.items())
        return (
            f"TimeCadence(interval={self.interval:.1f}, check_every={self.check_every}, "
            f"saves={self.saves}{planned})"
        )

    def __call__(self, step: int) -> bool:
        if step % self.check_every:
            return False
        now = self.clock()
        due = self._agree(now - self.last >= self.interval)
        if due:
            self.last = now
            self.saves += 1
        return due

    def _agree(self, due: bool) -> bool:
        distributed = self._distributed
        if distributed is None:
            distributed = _dist_ready()
        if not distributed:
            return due
        import torch
        import torch.distributed as dist

        # MIN: save only once every rank's clock says so, so no rank enters a save alone.
        flag = torch.tensor([1 if due else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())
