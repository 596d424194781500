"""``CheckpointManager`` itself: what it is built from, the cadence, and what it knows of
itself (:meth:`health`); saving, maintenance, loading and the end of a run are its other
modules (:mod:`tierstore.manager`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch.distributed as dist

from tierstore import _dist
from tierstore.dcp.writer import store_to_save
from tierstore.errors import ConfigError, SaveFailed, StorageError
from tierstore.lifecycle.retention import Retention
from tierstore.lifecycle.rounds import BackgroundRounds
from tierstore.manager import writable
from tierstore.manager.ending import Ending
from tierstore.manager.health import Health
from tierstore.manager.loading import Loading
from tierstore.manager.maintenance import Maintenance
from tierstore.manager.preemption import Preempting
from tierstore.manager.removed import refuse_removed
from tierstore.manager.runs import Runs, run_of
from tierstore.manager.saving import Saving
from tierstore.migration.migrator import (
    MigrationConfig,
    MigrationState,
)
from tierstore.options import ManagerOptions, Preemption, Run, StagingOptions, WriterOptions
from tierstore.staging import ReusedStaging
from tierstore.tiers import runlock
from tierstore.tiers.tier import Store, TierURL

__all__ = ["CheckpointManager", "DEFAULT_CLOSE_TIMEOUT"]

log = logging.getLogger(__name__)

Cadence = Callable[[int], bool]
_T = TypeVar("_T")
DEFAULT_CLOSE_TIMEOUT = ManagerOptions().close_timeout  # seconds close() waits for migrations, in all


class CheckpointManager(Runs, Saving, Maintenance, Loading, Ending, Preempting):
    """Save every ``save_every`` steps, resume from the newest checkpoint, keep tiers pruned.

    Args:
        hot, cold: the store's tiers (URLs or paths), or a :class:`~tierstore.Store` as
            ``hot`` where tier options or node-local hot tiers are needed
            (``Store(hot, cold, cold_options=..., node_local=True)``).
        retention: what each tier keeps, and how far a full hot tier is pruned beyond its
            policy (:class:`~tierstore.Retention`; default: hot keeps the last 2, cold keeps
            everything).
        save_every: an int (every N steps), a callable ``step -> bool`` (e.g. a
            :class:`tierstore.resume.cadence.TimeCadence`), or ``None`` to save whenever asked.
        migration: how this process migrates to the cold tier (:class:`~tierstore.MigrationConfig`).
        writer: how each save is written (:class:`~tierstore.WriterOptions`: threads,
            encoding, ...).
        staging: how the state is taken off the training loop
            (:class:`~tierstore.StagingOptions`: ``dcp.async_save`` or ``dcp.save``, thread
            or process, reused or fresh buffers, overlap).
        preemption: save on a scheduler's preemption notice (default ``True``: SIGTERM, a 30 s
            grace period; a :class:`~tierstore.Preemption` names other signals and another
            period; ``False``: off). The next ``save()`` after the signal saves that step on
            every rank and pushes it to the cold tier within the grace period; then
            :attr:`preempted` is ``True`` (:mod:`tierstore.manager.preemption`).
        run: the run it saves for and resumes: a name (``Run(name)``) or a
            :class:`~tierstore.Run`; ``load_latest`` then resumes only that run's checkpoints
            (:mod:`tierstore.manager.runs`). ``None`` (default): the newest, whoever saved it.
        options: what the manager itself needs beyond these
            (:class:`~tierstore.ManagerOptions`: ``close_timeout``, 300 s by default, the
            most seconds :meth:`close` waits for migrations, pruning and checks in all;
            ``process_group``, by default a new gloo group).

    An argument of an older form (``hot_options=``, ``node_local=``, ``hot_policy=``,
    ``async_mode=``, ``writer_options=``, ``close_timeout=``, ...) is a ``TypeError`` naming
    the form that replaced it (:mod:`tierstore.manager.removed`).

    ``stalls`` maps each saved step to the seconds ``save()`` blocked the caller;
    ``staging_allocated`` maps it to the bytes of staging buffers that save allocated: the
    whole state on the first save and after the state's structure changed, else 0.
    """

    def __init__(
        self,
        hot: TierURL | Store,
        cold: TierURL | None = None,
        *,
        save_every: int | Cadence | None = None,
        retention: Retention | None = None,
        run: str | Run | None = None,
        preemption: Preemption | bool = True,
        staging: StagingOptions | None = None,
        writer: WriterOptions | None = None,
        migration: MigrationConfig | None = None,
        options: ManagerOptions | None = None,
        **removed: Any,
    ) -> None:
        refuse_removed(removed)
        self.run = run_of(run)
        self.retention = _given("retention", retention, Retention)
        self.staging = _given("staging", staging, StagingOptions)
        self.writer = _given("writer", writer, WriterOptions)
        options = _given("options", options, ManagerOptions)
        if isinstance(save_every, int) and save_every <= 0:
            raise ConfigError(f"save_every must be positive, got {save_every}")
        self.store = store_to_save(hot, cold, hot_options=None, cold_options=None, owner="CheckpointManager")
        node_local = self.store.node_local
        # Node-local hot tiers each hold some ranks' files: the cold tier is the shared catalog.
        self.catalog = Store.of_tiers(None, self.store.cold) if node_local else self.store
        self.save_every = save_every
        self.node_local, self.migration = node_local, migration
        self.close_timeout = options.close_timeout
        self._writer(0, {})  # what only a TieredWriter checks (the environment's settings) fails here
        self._stager: ReusedStaging | None = None  # made by the first save, freed by close()
        self._staging: Future[None] | None = None  # the last save's copy of the state
        self._thread: ThreadPoolExecutor | None = None  # starts saves with StagingOptions(overlap=True)
        self.distributed = _dist.initialized()
        self.rank = _dist.rank_world()[0]
        self._owns_group = options.process_group is None and self.distributed
        self.group = dist.new_group(backend="gloo") if self._owns_group else options.process_group
        self._check_hot_writable()  # a read-only or foreign hot directory: refused now, every rank
        self._check_runs()  # another run's checkpoints in the hot tier: warned about, once
        self._pending: Future[None] | None = None  # settles once the save is recorded
        self._rounds = BackgroundRounds(
            lambda full: self._maintain(prune=full), name="tierstore-prune", on_error=self._round_failed
        )
        self._quarantined: list[str] = []
        self._inherited: set[str] | None = None  # pending from earlier jobs, once a round read cold
        self._closing = False  # close() began: rounds prune, but queue no more migrations
        self._cold_down = False  # close() found the cold tier unreachable: nothing to look up
        self._reported: set[str] = set()  # migration failures wait() raised already
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None
        self._unraised: SaveFailed | None = None  # a failed save not yet raised to the caller
        self._last_failure: str | None = None
        self._saves_ok = self._saves_failed = 0
        self._last_saved_step: int | None = None
        self._prune_errors: list[str] = []
        self.stalls: dict[int, float] = {}  # step -> seconds the caller was blocked by save()
        self.staging_allocated: dict[int, int] = {}  # step -> bytes its staging allocated
        # Another live job saving into this hot directory is warned about now, once.
        self._run_lock = (
            runlock.acquire(self.store.hot) if self.rank == 0 and self.store.hot is not None else None
        )
        if self._resumes_pending:  # a killed run's pending migrations: finished in the background
            self._prune_in_background(prune=False)
        elif self.node_local and self.store.cold is not None:
            self._resume_node_local()
        self._watch_preemption(preemption)  # last: nothing after it can fail and leave handlers

    def _check_hot_writable(self) -> None:
        try:
            writable.check_writable(self._hot, self.group, every_rank=self.node_local)
        except StorageError:
            if self._owns_group and self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
            raise

    def should_save(self, step: int) -> bool:
        if self.save_every is None:
            return True
        if callable(self.save_every):
            return bool(self.save_every(step))
        return step % self.save_every == 0

    def health(self) -> Health:
        """Saves, migrations and pruning as this process knows them (never raises, never
        sends a request to a tier)."""
        now = time.time()
        statuses = [s for m in self._migrators() for s in m.status()]
        failed = tuple(s for s in statuses if s.state is MigrationState.FAILED)
        busy = [s for s in statuses if s.state in (MigrationState.PENDING, MigrationState.UPLOADING)]
        with self._lock:
            return Health(
                saves_ok=self._saves_ok,
                saves_failed=self._saves_failed,
                last_saved_step=self._last_saved_step,
                last_error=self._last_failure,
                migrations_pending=len(busy),
                migrations_failed=failed,
                migration_lag_seconds=max((now - s.created for s in busy), default=0.0),
                migration_lag_bytes=sum(s.lag_bytes for s in busy),
                prune_errors=tuple(self._prune_errors),
                quarantined=tuple(dict.fromkeys(self._quarantined)),
            )


def _given(param: str, value: Any, cls: type[_T]) -> _T:
    """``CheckpointManager(param=value)``: an instance of ``cls``, or ``cls()`` for ``None``."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"CheckpointManager({param}=) takes a {cls.__name__}, got {type(value).__name__}")
    return value
