"""torchtitan's DCP checkpointer, saving to and loading from a tiered store.

The one-line change in a torchtitan job config::

    checkpoint=TieredCheckpointManager.Config(enable=True, folder="checkpoint", cold="s3://bucket/run")

instead of ``CheckpointManager.Config(...)``: the checkpoint folder (under the dump folder)
becomes the hot tier, ``cold`` the optional cold tier. What maps to what:

- a save of step N (``<folder>/step-N`` in torchtitan) is a ``TieredWriter`` save named
  ``step-N`` with step N, committed by its manifest (docs/design.md invariant 1), migrated
  to the cold tier in the background (invariant 9: the save never waits for it);
- ``async_mode="async"`` is ``dcp.async_save`` with that writer, ``"async_with_pinned_mem"``
  the same with torchtitan's pinned-memory stager in a process (it needs an accelerator);
- resume (``load(step)``, latest when -1) resolves the newest committed checkpoint in either
  tier, so a job whose node-local hot tier is gone resumes from cold; with none, torchtitan's
  own path runs unchanged (``initial_load_path``, a folder of plain DCP checkpoints, a fresh
  start), so a run moved from a plain folder resumes from its last plain checkpoint;
- ``keep_latest_k`` prunes the hot tier with ``keep_last(k)`` on rank 0, in the background;
  prune keeps every hot checkpoint the cold tier does not hold yet (invariant 15), and the
  cold tier keeps everything (prune it with ``tierstore prune``);
- rank 0 resumes the migrations it finds pending (a killed run's, or ones a cold outage
  failed): at start and after each prune, as ``CheckpointManager`` does;
- a SIGTERM (``preemption``, on by default) is heard at the next ``save()``, which every
  step calls: it saves that step, whatever the interval, waits for its hot commit, pushes it
  to the cold tier within ``preemption_grace_seconds`` and sets ``preempted``. torchtitan's
  trainer has no preemption path of its own; the one line a trainer adds is
  ``def should_continue_training(self): return super().should_continue_training() and not
  self.checkpointer.preempted``, so the loop stops at that step and closes as usual;
- ``close()`` (torchtitan's trainer calls it at the end) waits for the last save and then,
  up to ``close_timeout`` seconds (300), for its migrations, logging what it waits for; what
  is left is logged at ERROR, naming each checkpoint that stays pending in the hot tier
  (the next run resumes it), and nothing of it runs after close (docs/design.md
  invariant 22).

Not supported: ``last_save_in_hf`` (a Hugging Face export is a plain folder of safetensors,
not a checkpoint of the store; export after training instead), refused when the manager is
built.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
    async_save,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from tierstore import _dist
from tierstore.dcp.reader import TieredReader
from tierstore.dcp.writer import TieredWriter
from tierstore.errors import CheckpointNotFound, ConfigError
from tierstore.lifecycle.prune import check_cold_copies, prune
from tierstore.lifecycle.retention import keep_last
from tierstore.lifecycle.rounds import BackgroundRounds
from tierstore.manager.ending import Delivery
from tierstore.manager.notice import NoticeHandler
from tierstore.manager.preemption import PreemptionReport
from tierstore.migration.delivery import await_delivery, resume_pending
from tierstore.migration.migrator import Migrator
from tierstore.migration.workers import migrator_for
from tierstore.options import PreemptionOptions
from tierstore.tiers.catalog import CheckpointInfo, list_checkpoints
from tierstore.tiers.tier import Store

__all__ = ["TieredCheckpointManager"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-([0-9]+)")


def _name_and_step(checkpoint_id: str) -> tuple[str, int]:
    """torchtitan's ``<folder>/step-N`` as the store's checkpoint ``step-N`` at step N."""
    name = checkpoint_id.rstrip("/").rsplit("/", 1)[-1]
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        raise ConfigError(f"torchtitan checkpoint id {checkpoint_id!r} does not end in step-<N>")
    return name, int(match.group(1))


# torchtitan ships no type information mypy follows, so its classes are Any here.
class TieredCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager`` with a tiered store under it (see the module doc)."""

    # torchtitan builds the class that declares the config: a subclass must declare its own.
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        cold: str | None = None
        """Cold tier URL (``s3://``, ``gs://``, any fsspec URL, a directory); None: hot only."""

        close_timeout: float = 300.0
        """Seconds ``close()`` waits for the last checkpoints to reach the cold tier."""

        preemption: bool = True
        """Save on SIGTERM: the next ``save()`` saves that step, whatever the interval, and
        pushes it to the cold tier within ``preemption_grace_seconds``; then ``preempted``
        is True (the trainer's loop stops on it: module docstring)."""

        preemption_grace_seconds: float = 30.0
        """Seconds from the signal to the process's exit (the scheduler's grace period)."""

    def __init__(self, config: TieredCheckpointManager.Config, **kwargs: Any) -> None:
        if config.enable and config.last_save_in_hf:
            raise ConfigError(
                "last_save_in_hf writes a plain Hugging Face folder, not a checkpoint "
                "of the tiered store: set it to False and export after training"
            )
        self._cold = config.cold
        self._close_timeout = float(config.close_timeout)
        self._pruning = BackgroundRounds(lambda _: self._prune_hot(), name="tierstore-titan-prune")
        self._closed = False
        self._built: Store | None = None
        self._force_save = False
        self._notice = NoticeHandler(None)  # the manager's part, watching once torchtitan's is built
        options = (
            PreemptionOptions(grace_seconds=config.preemption_grace_seconds) if config.preemption else None
        )
        super().__init__(config, **kwargs)
        if self.enable and options is not None:
            self._notice = NoticeHandler(options)
        if self.enable:
            self._store().check_schemes()  # a missing backend plugin fails here, not at step N
            if self._cold is not None and _dist.rank_world()[0] == 0:
                threading.Thread(
                    target=self._resume_pending, daemon=True, name="tierstore-titan-resume"
                ).start()

    def _store(self) -> Store:
        if self._built is None:  # one store: its tiers share their clients and caches
            self._built = Store.of(self.folder, self._cold)
        return self._built

    def _migrator(self) -> Migrator | None:
        store = self._store()
        if store.hot is None or store.cold is None:
            return None
        return migrator_for(store.hot, store.cold)

    def _resume_pending(self, pending: Iterable[str] | None = None) -> None:
        store, migrator = self._store(), self._migrator()
        if migrator is None or store.hot is None or store.cold is None or self._closed:
            return
        try:
            names = check_cold_copies(store.hot, store.cold).pending if pending is None else pending
            resume_pending(migrator, store.hot, names)
        except Exception as err:  # background work: logged, never raised into training
            log.error("could not resume pending migrations: %s", err)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        if to_hf:
            raise ConfigError("Hugging Face exports are not saved to the tiered store")
        name, step = _name_and_step(checkpoint_id)
        writer = TieredWriter(self._store(), step=step, name=name)
        result: Future[Any] | AsyncSaveResponse | None
        if async_mode == AsyncMode.DISABLED:
            dcp_save(state_dict, storage_writer=writer)
            result = None
        elif async_mode == AsyncMode.ASYNC:
            result = async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            result = async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        since = self._notice.seen()  # every step: combined across ranks (tierstore.manager.preemption)
        if since is None:
            return bool(super()._save(curr_step, last_step))
        saved = False

        def write() -> None:  # a full checkpoint, to resume from: never the last step's model-only one
            nonlocal saved
            self._force_save = True
            try:
                saved = bool(super(TieredCheckpointManager, self)._save(curr_step, last_step=False))
                self.maybe_wait_for_saving()  # committed in the hot tier
            finally:
                self._force_save = False

        def migrators() -> list[Migrator]:
            migrator = self._migrator()
            return [migrator] if migrator is not None else []

        self._notice.save(curr_step, since, write, migrators, name=f"step-{curr_step}")
        return saved

    @property
    def preemption(self) -> PreemptionReport | None:
        """What the save on a preemption notice managed, once one ran."""
        return self._notice.report

    @property
    def preempted(self) -> bool:
        """Whether a save acted on a preemption notice: the trainer should stop
        (``should_continue_training()`` returning ``... and not self.checkpointer.preempted``).
        Reading it once it is ``True`` hands the end of the run to the trainer; a trainer
        that never reads it is ended at the grace deadline, as the signal would have ended
        it (tierstore.manager.preemption)."""
        return self._notice.preempted

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return self._force_save or bool(super()._should_save(curr_step, last_step))

    def _load(self, step: int = -1) -> bool:
        info = self._committed(step)
        if info is None:
            if step != -1:
                raise CheckpointNotFound(f"no committed checkpoint of step {step}", tier=self._store().label)
            return bool(super()._load(step))
        assert info.step is not None
        log.info("loading checkpoint %s (step %d) from %s", info.name, info.step, ", ".join(info.tiers))
        # Step 0 is torchtitan's seed checkpoint: model only, as its own loader does.
        states = self._states_to_load(model_only=info.step == 0)
        dcp_load(states, storage_reader=TieredReader(self._store(), name=info.name))
        if MODEL in self.states:
            # torchtitan flattens the model's entries into the top level of what it loads.
            self.states[MODEL].load_state_dict(states)
        return True

    def _committed(self, step: int) -> CheckpointInfo | None:
        found = [
            c
            for c in list_checkpoints(self._store())
            if c.step is not None and _STEP_DIR.fullmatch(c.name) and step in (-1, c.step)
        ]
        return found[-1] if found else None

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and _dist.rank_world()[0] == 0:
            self._pruning.request()  # one round at a time, as the manager prunes

    def _prune_hot(self) -> None:
        for report in prune(self._store(), hot_policy=keep_last(self.keep_latest_k), prune_cold=False):
            for error in report.errors:
                log.warning("pruning the hot tier: %s", error)
            if report.pending:
                self._resume_pending(report.pending)

    def _close(self) -> None:
        """Wait for the last save and deliver it (module docstring); once, and never as the
        interpreter shuts down (torchtitan's ``__del__`` calls this too)."""
        if self._closed or sys.is_finalizing():
            return
        self._closed = True
        deadline = time.monotonic() + self._close_timeout
        watch = self._notice.watch
        if watch is not None and watch.deadline is not None:  # after a preemption notice: its grace period
            deadline = min(deadline, watch.until())
        self._notice.release()
        if self.save_future is not None:
            self.maybe_wait_for_saving()  # the last async save is committed in hot
        super()._close()
        pruning = self._pruning.running()
        if pruning is not None:
            with contextlib.suppress(FutureTimeout):
                pruning.result(max(0.0, deadline - time.monotonic()))
        migrator, store = self._migrator(), self._store()
        if migrator is None or store.hot is None or store.cold is None:
            return
        await_delivery([migrator], deadline)
        delivery = Delivery(store, lambda: [migrator], catalog=True)  # the manager's part
        left = delivery.undelivered(deadline, in_grace=False)  # looked up for at least 5 s
        delivery.stop(set(left))
        if left:
            log.error("%s", delivery.failed(left))
