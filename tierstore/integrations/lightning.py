"""PyTorch Lightning drop-in: :class:`TierstoreCheckpoint`, a ``ModelCheckpoint`` that saves to tiers.

The one-line change (in place of ``ModelCheckpoint(...)``, with the same arguments)::

    trainer = Trainer(strategy=ModelParallelStrategy(), callbacks=[
        TierstoreCheckpoint("/nvme/run1", "s3://bucket/run1", monitor="val_loss", save_top_k=2,
                            save_last=True, every_n_epochs=1)])
    trainer.fit(model, ckpt_path="last")   # the newest checkpoint in the store, hot or cold

Why a callback: Lightning calls a ``CheckpointIO`` plugin on rank 0 only, and its sharded
strategies (``ModelParallelStrategy``, ``FSDPStrategy``) bypass ``CheckpointIO`` for
distributed checkpoints; a ``ModelCheckpoint`` runs on every rank and already decides *when*
to save (``every_n_*``, ``monitor``/``save_top_k``, ``save_last``). Here each of its saves is
one collective :meth:`CheckpointManager.save <tierstore.CheckpointManager.save>` of step
``global_step``: ``dcp.async_save`` through ``TieredWriter``, so training resumes once the
state is staged, and the cold tier is filled by the manager's background migrator. The
model's state is what the strategy gives (DTensor shards under ``ModelParallelStrategy``,
the replicated state under DDP, written once by DCP); optimizer states are saved by
parameter name (``get_optimizer_state_dict``), the rest of Lightning's checkpoint dict
(loops, callbacks, schedulers, hyper-parameters) as one ``torch.save`` blob.

What ModelCheckpoint deletes, a retention policy prunes instead (:func:`policy_for`):
``save_top_k=k`` with ``monitor`` is ``keep_best(monitor, k, mode)`` over the metric each
save recorded, without ``monitor`` ``keep_last(k)``, ``-1`` keeps all; ``save_last`` adds
``keep_last(1)``. Several saves at one step (top-k and last) are one checkpoint.

Resuming: Lightning has no hook to read a checkpoint for a sharded strategy (they read the
path with DCP's ``FileSystemReader``), so :meth:`TierstoreCheckpoint.setup` points that
strategy's ``load_checkpoint`` and ``load_optimizer_state_dict`` at this callback; paths
it does not know go to the strategy's own. It knows ``"last"`` (Lightning resolves it to
:attr:`TierstoreCheckpoint.last_path` when the store holds a checkpoint) and
:meth:`TierstoreCheckpoint.step_path`, which is every path it gives Lightning
(``best_model_path``, ``best_k_models``, ``last_model_path``: there is no ``.ckpt`` file).
``LightningModule.load_from_checkpoint`` reads through fsspec instead: a ``tierstore://``
path raises a :class:`ConfigError` there naming the calls that read it. ``ModelCheckpoint``'s
file-name arguments (``dirpath``, ``filename``, ``auto_insert_metric_name``,
``enable_version_counter``) are named in a warning when given. Optimizer states are loaded
once the strategy built the optimizers (under DDP after the model), from the same step.

Preemption: while fitting, the callback takes over Lightning's SIGTERM handling
(:mod:`tierstore.integrations._lightning_sigterm`: Lightning's own handler runs a collective
inside the signal handler, which deadlocks when the ranks are at different points). The
handler only records; at the end of every training batch the ranks combine what they
recorded, and a notice on any rank makes Lightning raise ``SIGTERMException`` on every rank at
that batch (the script exits 0); the callback then saves that step, whatever
``save_on_exception`` says, and pushes it to the cold tier within the grace period of the
manager's ``PreemptionOptions`` (``manager_options={"preemption": PreemptionOptions(grace_seconds=90)}``;
default 30 s). ``fit(ckpt_path="last")`` in the requeued job resumes from it.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import fsspec
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tierstore import _dist
from tierstore.dcp.writer import store_to_save
from tierstore.errors import CheckpointNotFound, ConfigError, MigrationFailed, TierstoreError
from tierstore.integrations._lightning_args import (
    _check_manager_options,
    _check_strategy,
    _retention,
    _warn_unused,
    policy_for,
)
from tierstore.integrations._lightning_sigterm import SigtermTakeover
from tierstore.lifecycle.retention import Retention
from tierstore.manager import CheckpointManager
from tierstore.manager.preemption import preemption_options
from tierstore.manager.removed import REPLACED
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.tier import Store, TierURL

__all__ = ["TierstoreCheckpoint", "policy_for"]

log = logging.getLogger(__name__)

_STEP_PREFIX = "tierstore://step="  # what Lightning's paths name (best_model_path, ...)
_OLD_STEP_PREFIX = "tierstore:step="  # step_path's older form, still resumed from
_STEP_IN_NAME = re.compile(r"(?:^|[^A-Za-z0-9_])step=(\d+)")
_REST = "lightning"  # Lightning's checkpoint dict less model and optimizers, one blob
_OPTIMIZERS = "tierstore_optimizers"  # in that dict: how many optimizer states are in DCP


_NOT_A_FILE = (
    "{path} names a tierstore checkpoint, not a file: LightningModule.load_from_checkpoint and "
    "torch.load cannot read it. Resume with trainer.fit(model, ckpt_path={path!r}) (or "
    "TierstoreCheckpoint.step_path(N), callback.best_model_path) with the TierstoreCheckpoint "
    "callback in the trainer; outside a trainer, load the state with "
    "CheckpointManager(hot, cold).load(state, step=N) or "
    "dcp.load(state, storage_reader=TieredReader(hot, cold, step=N))"
)


class _StepPaths(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """``tierstore://step=N`` to fsspec (how Lightning's ``pl_load`` opens a path): opening one
    raises the :class:`ConfigError` naming the calls that do read it."""

    protocol = "tierstore"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raise ConfigError(_NOT_A_FILE.format(path=_STEP_PREFIX + str(path).removeprefix("step=")))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return {"name": path, "size": 0, "type": "file"}


fsspec.register_implementation("tierstore", _StepPaths, clobber=True)


class TierstoreCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` whose checkpoints are tierstore checkpoints (module docstring).

    Args:
        hot, cold: the store's tiers (URLs), or a :class:`~tierstore.Store` as ``hot``. The hot
            tier must be a local directory for ``ckpt_path="last"`` (Lightning checks it exists).
        retention: what each tier keeps (:class:`~tierstore.Retention`); by default both
            keep what ``ModelCheckpoint`` would (:func:`policy_for`).
        manager_options: further :class:`~tierstore.CheckpointManager` arguments
            (``staging=StagingOptions(...)``, ``writer=WriterOptions(...)``, ``migration``,
            ``options=ManagerOptions(...)``, ...); a key the manager does not take is a
            ``TypeError`` here (tier options go on a :class:`~tierstore.Store` as ``hot``).
        **checkpoint_options: ``ModelCheckpoint``'s arguments (``monitor``, ``mode``,
            ``save_top_k``, ``save_last``, ``every_n_train_steps``, ``every_n_epochs``, ...).
    """

    def __init__(
        self,
        hot: TierURL | Store,
        cold: TierURL | None = None,
        *,
        retention: Retention | None = None,
        manager_options: Mapping[str, Any] | None = None,
        **checkpoint_options: Any,
    ) -> None:
        for old in ("hot_policy", "cold_policy"):
            if old in checkpoint_options:
                raise TypeError(f"TierstoreCheckpoint() no longer takes {old}=: pass {REPLACED[old]}")
        _warn_unused(checkpoint_options)
        super().__init__(**checkpoint_options)
        options = dict(manager_options or {})
        self.store = store_to_save(hot, cold, owner="TierstoreCheckpoint")
        _check_manager_options(options)
        policy = policy_for(self.monitor, self.save_top_k, self.mode, self.save_last)
        self.retention = _retention(retention, policy)
        self.manager_options = options
        self.manager: CheckpointManager | None = None  # made in setup(): it needs the group
        self._saved_step: int | None = None
        self._restored_step: int | None = None  # the step a resume loaded the model from
        self._restore_originals: dict[str, Callable[..., Any]] = {}
        self._strategy: Strategy | None = None
        self._fitting = False
        self._committed: set[int] = set()  # steps the store held beyond the resumed one
        self._sigterm = SigtermTakeover()
        # The step whose batch ended last and the monitored value Lightning held then, before
        # any validation or epoch end at that step (_reported); the score the save under way
        # is ranked by (_update_best_and_save).
        self._held: tuple[int, object] | None = None
        self._ranked: float | None = None

    # -- the paths Lightning passes around ------------------------------------------------

    @property
    def last_path(self) -> str:
        """What ``ckpt_path="last"`` resolves to: the hot tier's root."""
        assert self.store.hot is not None  # store_to_save refused a store without one
        return self.store.hot.url

    @staticmethod
    def step_path(step: int) -> str:
        """A ``ckpt_path`` naming the newest checkpoint of ``step`` in the store."""
        return f"{_STEP_PREFIX}{step}"

    def _step_of(self, path: object) -> tuple[bool, int | None]:
        """Whether ``path`` names a checkpoint of this store, and its step (``None``: newest)."""
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if text is None:
            return False, None
        for prefix in (_STEP_PREFIX, _OLD_STEP_PREFIX):
            if text.startswith(prefix):
                return True, int(text[len(prefix) :])
        if os.path.normpath(text) == os.path.normpath(self.last_path):
            return True, None
        found = _STEP_IN_NAME.search(os.path.basename(text))
        if (
            self.dirpath is not None
            and found is not None
            and (os.path.normpath(os.path.dirname(text)) == os.path.normpath(self.dirpath))
        ):
            return True, int(found.group(1))
        return False, None

    def format_checkpoint_name(
        self,
        metrics: dict[str, torch.Tensor],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        """Every path Lightning gives a save (``best_model_path``, ``best_k_models``,
        ``last_model_path``, ``kth_best_model_path``) is :meth:`step_path` of its step: what
        ``fit(ckpt_path=...)`` resumes from. There is no ``.ckpt`` file (``filename`` and
        ``dirpath`` are not used: the callback warned when built)."""
        step = metrics.get("step")
        if step is None:  # not a save's metrics (Lightning always adds the step to those)
            return super().format_checkpoint_name(metrics, filename, ver, prefix)
        return self.step_path(int(step))

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        # Runs before the process group exists: every rank lists the store once.
        if not list_checkpoints(self.store):
            return set()
        if "://" not in self.last_path:  # Lightning asks the filesystem for its mtime
            os.makedirs(self.last_path, exist_ok=True)
        return {self.last_path}

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        _check_strategy(trainer.strategy)
        if self.manager is None:
            self.manager = CheckpointManager(self.store, retention=self.retention, **self.manager_options)
        strategy = trainer.strategy
        for name, replacement in (
            ("load_checkpoint", self._load_checkpoint),
            ("load_optimizer_state_dict", self._load_optimizers),
        ):
            if name not in self._restore_originals:
                self._restore_originals[name] = getattr(strategy, name)
                setattr(strategy, name, replacement)  # on this instance only: see docstring
        self._strategy, self._fitting = strategy, stage == "fit"
        self._held = None
        if self._fitting:  # before Lightning registers its handlers, which it does after setup
            self._sigterm.install(trainer, preemption_options(self.manager_options.get("preemption", True)))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Wait for the last save and its migration; give the strategy its loaders back."""
        for name, original in self._restore_originals.items():
            setattr(self._strategy, name, original)
        self._strategy = None
        self._restore_originals.clear()
        self._sigterm.release()
        if self.manager is not None:
            manager, self.manager = self.manager, None
            try:
                manager.close()  # waits, boundedly, for the last checkpoints to reach cold
            except MigrationFailed:
                pass  # close() said at ERROR which stay pending; the next run resumes them
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """On a preemption notice (Lightning's ``SIGTERMException``, raised on every rank at
        the batch after a SIGTERM): save this step and push it to the cold tier within the
        manager's grace period (:mod:`tierstore.manager.preemption`), whatever
        ``save_on_exception`` says. On any other exception, after ``save_on_exception``'s
        save: wait for the save in flight to commit, not for migrations (``tierstore
        migrate`` or the next run's migrator finishes those)."""
        super().on_exception(trainer, pl_module, exception)
        preempted = isinstance(exception, SIGTERMException) and self._fitting
        if self.manager is not None and preempted and not self.manager.preempted:
            try:
                self._save_step(trainer, trainer.global_step)  # a step saved already is only pushed
            except TierstoreError as err:
                log.error("the save on the preemption notice failed: %s", err)
        self._sigterm.release()
        if self.manager is not None:
            manager, self.manager = self.manager, None
            try:
                manager.close(timeout=0.0)
            except TierstoreError as err:  # the training error is the one to raise
                log.error("while stopping on %s: %s", type(exception).__name__, err)

    # -- saving ----------------------------------------------------------------------------

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        step = trainer.global_step
        if step in self._committed:
            log.warning("step %d is already committed in %s: not saved again", step, self.store.label)
        elif self._saved_step != step:  # top-k and last at one step: one checkpoint
            self._save_step(trainer, step)
            self._saved_step = step
        self._last_global_step_saved = step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _save_step(self, trainer: Trainer, step: int) -> None:
        assert self.manager is not None, "setup() makes the manager"
        if self.save_last:  # the newest checkpoint is this one: the state it saves says so
            self.last_model_path = self.step_path(step)  # (Lightning sets it after a top-k save)
        # The dict trainer.save_checkpoint would write, without writing it.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        if checkpoint.pop("optimizer_states", None) is not None:
            # By parameter name: Lightning's DDP states are keyed by position, which DCP's
            # flattening turns into strings that optimizer.load_state_dict silently skips.
            model = trainer.strategy.model
            assert model is not None
            for i, optimizer in enumerate(trainer.optimizers):
                state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer)
            checkpoint["optimizer_states"] = []
            checkpoint[_OPTIMIZERS] = len(trainer.optimizers)
        # One blob: DCP's flattening would drop empty dicts the loops' states need.
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        state[_REST] = buffer.getvalue()
        self.manager.save(step, state, force=True, metrics=self._metrics(trainer))
        if self.manager.preempted:  # a notice heard at this save, on every rank: stop there
            self._sigterm.stop(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the cadence's save: a notice on any rank stops every rank at this batch
        (:mod:`tierstore.integrations._lightning_sigterm`)."""
        if self.monitor is not None and (self._held is None or self._held[0] != trainer.global_step):
            self._held = (trainer.global_step, trainer.callback_metrics.get(self.monitor))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._sigterm.active and self.manager is not None and self._sigterm.heard(self.manager):
            self._sigterm.stop(trainer)

    def _update_best_and_save(
        self, current: torch.Tensor, trainer: Trainer, monitor_candidates: dict[str, torch.Tensor]
    ) -> None:
        self._ranked = float(current)
        try:
            super()._update_best_and_save(current, trainer, monitor_candidates)
        finally:
            self._ranked = None

    def _metrics(self, trainer: Trainer) -> dict[str, float]:
        """What a save records of the monitored metric (docs/integrations.md, "Metrics"): the
        score ``ModelCheckpoint`` ranks it by, when it ranks it (so that ``keep_best`` keeps what
        ``best_k_models`` names); for any other save (the preemption save, ``save_on_exception``'s,
        ``save_last``'s own) the value Lightning reported at this step, and none when what it
        holds was reported at an earlier step (a validation before the preemption notice)."""
        if self.monitor is None:
            return {}
        value = self._ranked if self._ranked is not None else self._reported(trainer)
        if value is None or not math.isfinite(float(value)):
            return {}  # such a checkpoint is never among keep_best's best
        return {self.monitor: float(value)}

    def _reported(self, trainer: Trainer) -> Any:
        """The monitored value if Lightning reported it at this step; ``None`` if it is the one
        it held when this step's batch ended: at a save after that (a validation or an epoch end
        at this step, a notice or an exception in a later batch of this step) it dates from an
        earlier step. Lightning hands every ``callback_metrics`` entry it reports as a new
        tensor (and a training step's at every read), so an unchanged object was not reported
        again. ``step`` and ``epoch`` come from the trainer when not logged: always current."""
        value = trainer.callback_metrics.get(cast(str, self.monitor))
        if value is None:
            return self._monitor_candidates(trainer).get(cast(str, self.monitor))
        held = self._held
        return None if held is not None and held[0] == trainer.global_step and value is held[1] else value

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Nothing to delete: the retention policy prunes after each commit."""

    # An instance method where Lightning's is static: it calls it on the instance
    # (self._link_checkpoint), and the last path is this callback's own state.
    def _link_checkpoint(self, trainer: Trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        """``save_last="link"`` at a step not saved: the last checkpoint is ``filepath``, the
        newest one saved (Lightning had named ``linkpath``, this step's, which does not exist)."""
        self.last_model_path = filepath

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``ModelCheckpoint``'s state, whatever ``dirpath`` this run resolved: the paths it holds
        name the store's steps (:meth:`step_path`), not files under a directory (Lightning keeps
        only ``best_model_path`` when ``dirpath`` changed, as it does with ``default_root_dir``)."""
        super().load_state_dict({**state_dict, "dirpath": self.dirpath})

    # -- resuming --------------------------------------------------------------------------

    def _load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        ours, step = self._step_of(checkpoint_path)
        if not ours:
            original = self._restore_originals["load_checkpoint"]
            return cast(dict[str, Any], original(checkpoint_path, weights_only=weights_only))
        strategy = self._strategy
        assert self.manager is not None and strategy is not None
        module = strategy.lightning_module
        assert module is not None
        state: dict[str, Any] = {"state_dict": strategy.lightning_module_state_dict(), _REST: b""}
        found = self.manager.load_latest(state) if step is None else self.manager.load(state, step=step)
        if found is None:
            raise CheckpointNotFound(
                "no checkpoint to resume from" + ("" if step is None else f" at step {step}"),
                tier=self.store.label,
            )
        module.load_state_dict(state["state_dict"], strict=module.strict_loading)
        checkpoint: dict[str, Any] = torch.load(io.BytesIO(state[_REST]), weights_only=weights_only)
        checkpoint["state_dict"] = state["state_dict"]
        self._restored_step = found
        log.info("resumed from step %d of %s", found, self.store.label)
        if self._fitting:
            self._note_later_steps(found)
        if self._fitting and not strategy.lightning_restore_optimizer:
            # Sharded strategies restore optimizers in load_checkpoint (they exist by now);
            # Lightning then never calls load_optimizer_state_dict.
            self._load_optimizers(checkpoint)
        return checkpoint

    def _note_later_steps(self, resumed: int) -> None:
        """Resumed from an older step: this run's saves at steps the store already holds are
        skipped, as committed checkpoints are never overwritten (docs/design.md invariant 3)."""
        assert self.manager is not None
        coordinator = _dist.group_rank_world(self.manager.group)[0] == 0
        later = [s for s in self.manager.steps() if s > resumed] if coordinator else []
        self._committed = set(_dist.broadcast(later, self.manager.group))  # all ranks skip alike
        if self._committed:
            log.warning(
                "resumed from step %d, but %s holds later steps %s: this run will not "
                "save at those steps (committed checkpoints are never overwritten); "
                "delete them first to save there",
                resumed,
                self.store.label,
                sorted(self._committed),
            )

    def _load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        count = checkpoint.get(_OPTIMIZERS)
        if count is None or self._restored_step is None:
            self._restore_originals["load_optimizer_state_dict"](checkpoint)
            return
        strategy = self._strategy
        assert self.manager is not None and strategy is not None
        optimizers = strategy.optimizers
        if len(optimizers) != count:
            raise ConfigError(
                f"the checkpoint of step {self._restored_step} holds {count} "
                f"optimizer states, the model has {len(optimizers)} optimizers"
            )
        model = strategy.model
        assert model is not None
        state = {f"optimizer_{i}": get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)}
        self.manager.load(state, step=self._restored_step)
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state[f"optimizer_{i}"])
