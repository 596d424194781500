"""SIGTERM under Lightning without a collective in the signal handler (issue 35, item 4).

Lightning 2.6's ``_SignalConnector._sigterm_notifier_fn`` runs inside the SIGTERM handler: it
forwards the signal to the processes Lightning's launcher started, then ``dist.broadcast``s on
the default group. A handler runs between two bytecodes of whatever the main thread does, so
that broadcast pairs with whatever collective the other ranks are in: under
``python train.py`` with ``devices=2`` a SIGTERM to every rank reaches rank 1 twice (the
scheduler's and rank 0's forward), its second broadcast waits for rank 0, and rank 0 waits in
FSDP's ``all_gather`` for rank 1, for good.

:class:`SigtermTakeover` puts in its place, on the trainer's connector, a handler that only
forwards the first signal to the launcher's children (``os.kill``: no lock, no logging). The
manager's own handler, which Lightning calls after it, records the request. At the end of
every training batch, on every rank, :meth:`SigtermTakeover.heard` combines the request
across ranks on the manager's gloo group (the combine every ``save()`` runs, so the grace
period counts from the earliest signal); when any rank got one, every rank sets Lightning's
``received_sigterm`` at the same batch and Lightning raises ``SIGTERMException`` there on
every rank: one rank's signal, every rank's, or several, stop all ranks at one step.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from types import FrameType
from typing import Any

from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from tierstore.manager import CheckpointManager
from tierstore.options import PreemptionOptions

__all__ = ["SigtermTakeover"]

log = logging.getLogger(__name__)

_TESTED = "lightning 2.6"


class SigtermTakeover:
    """Lightning's SIGTERM handling, made safe for one fit (module docstring)."""

    def __init__(self) -> None:
        self._connector: Any = None
        self._children: list[Any] = []
        self._forwarded = False

    @property
    def active(self) -> bool:
        return self._connector is not None

    def install(self, trainer: Trainer, preemption: PreemptionOptions | None) -> None:
        """Replace the connector's notifier before Lightning registers its handlers (it does
        so after the callbacks' ``setup``); warn where a set-up stays unsafe."""
        _warn_requeue_handler(trainer, preemption)
        if preemption is None or signal.SIGTERM not in preemption.signals:
            if trainer.world_size > 1:
                _warn(
                    trainer,
                    "TierstoreCheckpoint leaves Lightning's own SIGTERM handler in place, as the "
                    "manager does not watch SIGTERM (manager_options preemption): that handler "
                    "runs a broadcast inside the signal handler, which deadlocks when ranks are "
                    "at different points (a rank signalled twice, one in FSDP's all_gather). "
                    "Keep preemption on (the default) to have SIGTERM stop every rank at one "
                    "step with a checkpoint",
                )
            return
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None or not all(
            hasattr(connector, name) for name in ("_sigterm_notifier_fn", "received_sigterm")
        ):
            _warn(
                trainer,
                f"TierstoreCheckpoint cannot take over this Lightning's SIGTERM handling (tested "
                f"with {_TESTED}): if its handler runs a collective inside the signal handler, "
                "SIGTERM can deadlock a multi-rank job. Use lightning 2.6 (tierstore[lightning])",
            )
            return
        launcher = trainer.strategy.launcher
        self._children = list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []
        self._forwarded = False
        connector._sigterm_notifier_fn = self._notify  # the instance's: Lightning's class is untouched
        self._connector = connector

    def _notify(self, number: int, frame: FrameType | None) -> None:
        """In the signal handler: forward the first signal to the launcher's children, as
        Lightning does (a signal to rank 0 alone reaches every local rank), and nothing else."""
        if self._forwarded:
            return
        self._forwarded = True
        for child in self._children:
            if child.returncode is None:  # not reaped: the pid is still its
                try:
                    os.kill(child.pid, number)
                except ProcessLookupError:
                    pass

    def heard(self, manager: CheckpointManager) -> bool:
        """Whether a preemption notice came to any rank (a collective: every rank calls it at
        the same batch); the manager acting on one already counts."""
        # The manager's notice handler (tierstore.manager.notice) combines it across ranks
        # (tierstore.manager.preemption, 2) on its own gloo group,
        # never the save group an async save may be using from its thread.
        return manager.preempted or manager._notice.seen() is not None

    def stop(self, trainer: Trainer) -> None:
        """Have Lightning raise ``SIGTERMException`` at its next check, on every rank alike
        (every rank calls this at the same batch or save)."""
        if self._connector is not None:
            self._connector.received_sigterm = True
        else:
            trainer.should_stop = True

    def release(self) -> None:
        if self._connector is not None and "_sigterm_notifier_fn" in vars(self._connector):
            del self._connector._sigterm_notifier_fn
        self._connector, self._children = None, []


def _warn_requeue_handler(trainer: Trainer, preemption: PreemptionOptions | None) -> None:
    """Lightning's Slurm auto-requeue saves a checkpoint from inside its requeue signal's
    handler (``_slurm_sigusr_handler_fn``: DCP collectives in a signal handler, and Lightning's
    own files, not a tierstore checkpoint); it installs it only where that signal has no
    handler yet, so one the manager watches keeps it out."""
    environment = trainer._accelerator_connector.cluster_environment
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return
    number = environment.requeue_signal or signal.SIGUSR1
    if preemption is not None and number in preemption.signals:
        return
    name = signal.Signals(number).name
    _warn(
        trainer,
        f"Lightning's Slurm auto-requeue saves its own checkpoint from inside the {name} "
        "handler (collectives in a signal handler: a sharded job can deadlock there, and the "
        f"checkpoint is not in the store). If Slurm sends {name} (--signal), pass "
        f"manager_options={{'preemption': PreemptionOptions(signals=(signal.SIGTERM, signal.{name}))}} "
        "(TierstoreCheckpoint then saves that step and stops every rank; requeue with "
        "#SBATCH --requeue), or plugins=[SLURMEnvironment(auto_requeue=False)]",
    )


def _warn(trainer: Trainer, message: str) -> None:
    if trainer.is_global_zero:  # once per job, not once per rank
        warnings.warn(message, UserWarning, stacklevel=4)
