"""``CheckpointManager``: the training loop's one object for saving, resuming and retention.

::

    manager = CheckpointManager("/nvme/run1", "s3://bucket/run1", save_every=500,
                                hot_policy=keep_last(2), cold_policy=keep_last(3) | keep_every(5000))
    start = manager.load_latest(state) or 0      # Stateful objects in `state` are restored
    for step in range(start + 1, total + 1):
        train_step()
        manager.save(step, state)                # skipped unless the cadence wants it
    manager.close()                              # waits for the last flush and migrations

Saves run through ``dcp.async_save`` (THREAD by default) on a process group of the manager's
own, so its collectives never interleave with training's. ``save()`` returns once the state
is copied into staging buffers that are allocated on the first save and reused by every later
one (:mod:`tierstore.staging`); from then on training may change the state. The next save
waits only for the previous flush. After each commit the coordinator prunes in the
background, so slow object store deletes never stall a save. Nothing on the save path sends
a request to the cold tier: a cold tier that is slow, stalled, down or denying writes delays
no save.

Failures are loud: a save that fails (in the background, under ``async_save``) is raised as
:class:`~tierstore.errors.SaveFailed` by the next :meth:`CheckpointManager.save`, or by
:meth:`~CheckpointManager.wait` / :meth:`~CheckpointManager.close` if no save follows, once.
Migration and pruning never raise into training (``save``); :meth:`CheckpointManager.health`
reports them, every failure is logged, and :meth:`~CheckpointManager.wait` and
:meth:`~CheckpointManager.close` raise :class:`~tierstore.errors.MigrationFailed` for a
checkpoint that did not reach the cold tier.

The end of a run delivers its last checkpoints, or says loudly that it did not (docs/design.md
invariant 22): ``close()`` waits for the pending migrations up to ``close_timeout`` seconds
in all (default 300; the deadline covers every wait of close, not each in turn), logging
what it waits for, then stops whatever is left (nothing of it runs after close returns) and
raises :class:`~tierstore.errors.MigrationFailed` naming each checkpoint that stays pending
in the hot tier. A manager with a cold tier resumes, in the background, the migrations it
finds pending: at start (a killed run's) and after each commit (those a cold outage failed).

A checkpoint a resume proved damaged (in every tier holding it) is quarantined
(:mod:`tierstore.lifecycle.quarantine`): un-published, its data kept, so the step it held is
saved again as a new attempt and retention counts only good checkpoints.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore import _dist
from tierstore.dcp.reader import TieredReader, is_damage
from tierstore.dcp.writer import TieredWriter, store_to_save
from tierstore.errors import ConfigError, MigrationFailed, SaveFailed, TierstoreError
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.format.manifest_format import check_metrics
from tierstore.lifecycle.prune import PruneReport, check_cold_copies, prune, prune_tier
from tierstore.lifecycle.quarantine import quarantine
from tierstore.lifecycle.retention import DEFAULT_COLD, DEFAULT_HOT, Policy, keep_none
from tierstore.resume.state import ResumePlanner, is_per_rank_key
from tierstore.staging import ReusedStaging, staging_options
from tierstore.tiers import marks, runlock
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.delivery import (
    PROBE_WAIT,
    await_delivery,
    describe,
    resume_pending,
    undelivered,
    unreachable,
)
from tierstore.tiers.migrator import (
    MigrationConfig,
    MigrationState,
    MigrationStatus,
    Migrator,
    files_by_rank,
)
from tierstore.tiers.tier import Store, Tier, TierURL
from tierstore.tiers.workers import active_migrators, migrator_for

if TYPE_CHECKING:
    from tierstore.resume.check import ResumeReport

__all__ = ["CheckpointManager", "Health"]

log = logging.getLogger(__name__)

Cadence = Callable[[int], bool]
DEFAULT_CLOSE_TIMEOUT = 300.0  # seconds close() waits for migrations, in all
RESUME_LOOK = 10.0  # seconds a node-local start waits for the cold tier to find what is pending


@dataclass(frozen=True)
class Health:
    """What a :class:`CheckpointManager` knows of its saves, migrations and pruning.

    ``ok`` is false while any save or migration has failed, or pruning reported an error.
    Migration figures are this process's migrator's (the coordinator's sees the commits).
    """

    saves_ok: int
    saves_failed: int
    last_saved_step: int | None
    last_error: str | None  # the newest save failure, "step N: ..."
    migrations_pending: int
    migrations_failed: tuple[MigrationStatus, ...]
    migration_lag_seconds: float  # age of the oldest migration not finished
    migration_lag_bytes: int  # bytes not yet in the cold tier
    prune_errors: tuple[str, ...]
    # Checkpoints this manager's resumes found damaged and set aside (their data kept:
    # `tierstore quarantine` lists every quarantined one, and removes them).
    quarantined: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.saves_failed or self.migrations_failed or self.prune_errors)


class CheckpointManager:
    """Save every ``save_every`` steps, resume from the newest checkpoint, keep tiers pruned.

    Args:
        hot, cold: the store's tiers (URLs), or a :class:`~tierstore.Store` as ``hot``.
        hot_policy / cold_policy: retention per tier (defaults: hot keeps the last 2, cold the
            last 3; add milestones with ``keep_last(3) | keep_every(1000)``).
        save_every: an int (every N steps), a callable ``step -> bool`` (e.g. a
            :class:`tierstore.resume.cadence.TimeCadence`), or ``None`` to save whenever asked.
        async_save: save with ``dcp.async_save`` (default) or ``dcp.save``.
        async_mode: ``"thread"`` or ``"process"`` (DCP's checkpointer types).
        node_local: the hot tier is per node (see ``TieredReader``).
        hot_min_free: before each save, if the hot tier has less free space than this many
            bytes (``"auto"``: 1.1x the newest checkpoint), prune down to what the invariants
            force (the newest, and checkpoints not yet in cold) and warn.
        process_group: group for checkpoint collectives; by default a new gloo group.
        writer_options: extra ``TieredWriter`` arguments (``thread_count``, ...).
        staging: ``"reuse"`` (default) copies the state into buffers kept from save to save;
            ``"fresh"`` is DCP's default, new buffers on every save (for comparison).
        overlap_staging: ``save()`` returns as soon as the copy has started, not once it is
            taken; the caller must not change the state until :meth:`wait_staged` returns
            (the next ``save``, ``wait`` and ``close`` wait for it too). Needs async
            ``"reuse"`` staging.
        close_timeout: the most seconds :meth:`close` waits for migrations, pruning and
            checks in all (default 300); what is left then stays pending in the hot tier
            and :meth:`close` raises :class:`~tierstore.errors.MigrationFailed`.

    ``stalls`` maps each saved step to the seconds ``save()`` blocked the caller;
    ``staging_allocated`` maps it to the bytes of staging buffers that save allocated: the
    whole state on the first save and after the state's structure changed, else 0.
    """

    def __init__(self, hot: TierURL | Store, cold: TierURL | None = None, *,
                 hot_policy: Policy | None = None, cold_policy: Policy | None = None,
                 save_every: int | Cadence | None = None, async_save: bool = True,
                 async_mode: str = "thread", hot_options: Mapping[str, Any] | None = None,
                 cold_options: Mapping[str, Any] | None = None, node_local: bool = False,
                 migration: MigrationConfig | None = None, hot_min_free: int | str | None = "auto",
                 process_group: Any = None, writer_options: Mapping[str, Any] | None = None,
                 staging: str = "reuse", overlap_staging: bool = False,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT) -> None:
        if async_mode not in ("thread", "process"):
            raise ConfigError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
        if staging not in ("reuse", "fresh"):
            raise ConfigError(f"staging must be 'reuse' or 'fresh', got {staging!r}")
        if overlap_staging and not (async_save and staging == "reuse"):
            raise ConfigError("overlap_staging needs async_save=True and staging='reuse' "
                              "(other saves copy the state before save() returns)")
        if isinstance(save_every, int) and save_every <= 0:
            raise ConfigError(f"save_every must be positive, got {save_every}")
        if not (isinstance(close_timeout, (int, float)) and 0 <= close_timeout < float("inf")):
            raise ConfigError(f"close_timeout must be a number of seconds >= 0, got {close_timeout!r}")
        self.store = store_to_save(hot, cold, hot_options=hot_options, cold_options=cold_options,
                                   owner="CheckpointManager")
        if node_local and self.store.cold is None:
            raise ConfigError("node_local=True needs both a hot and a cold tier")
        # Node-local hot tiers each hold some ranks' files: the cold tier is the shared catalog.
        self.catalog = Store.of_tiers(None, self.store.cold) if node_local else self.store
        self.hot_policy = hot_policy or DEFAULT_HOT
        self.cold_policy = cold_policy or DEFAULT_COLD
        self.save_every, self.hot_min_free = save_every, hot_min_free
        self.async_save, self.async_mode = async_save, async_mode
        self.node_local, self.migration = node_local, migration
        self.close_timeout = float(close_timeout)
        self.writer_options = dict(writer_options or {})
        self._writer(0, {})  # a typo in writer_options fails here, not at the first save
        self.staging, self.overlap_staging = staging, overlap_staging
        self._stager: ReusedStaging | None = None  # made by the first save, freed by close()
        self._staging: Future[None] | None = None  # the last save's copy of the state
        self._thread: ThreadPoolExecutor | None = None  # starts saves with overlap_staging
        self.distributed = _dist.initialized()
        self.rank = _dist.rank_world()[0]
        self._owns_group = process_group is None and self.distributed
        self.group = dist.new_group(backend="gloo") if self._owns_group else process_group
        self._pending: Future[None] | None = None  # settles once the save is recorded
        self._pruning: Future[None] | None = None  # the background round, if one runs
        self._prune_again = False  # a commit landed while it ran: prune once more
        self._quarantined: list[str] = []
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
        self._run_lock = (runlock.acquire(self.store.hot)
                          if self.rank == 0 and self.store.hot is not None else None)
        if self._resumes_pending:  # a killed run's pending migrations: finished in the background
            self._prune_in_background(prune=False)
        elif self.node_local and self.store.cold is not None:
            self._resume_node_local()

    # -- cadence -------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        if self.save_every is None:
            return True
        if callable(self.save_every):
            return bool(self.save_every(step))
        return step % self.save_every == 0

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, force: bool = False,
             metrics: Mapping[str, float] | None = None) -> bool:
        """Checkpoint ``state`` as ``step`` if the cadence wants it (or ``force``); ``True`` if saved.

        Returns once the state is copied (unless ``overlap_staging``): training may change
        it from then on. Raises :class:`~tierstore.errors.SaveFailed` if the previous
        (background) save failed; this save is then not started (call again to save). A
        synchronous save, or a copy of the state, that fails raises it at once.

        ``metrics`` (``{"val_loss": 0.41}``: at most 64 names, finite numbers) are recorded
        in this checkpoint's manifest, for :class:`~tierstore.lifecycle.retention.keep_best`
        and ``CheckpointInfo.metrics``; the coordinator's are the ones recorded. Invalid
        metrics raise :class:`~tierstore.errors.ConfigError` before anything is saved.
        """
        if not (force or self.should_save(step)):
            return False
        metrics = check_metrics(metrics, source="metrics", error=ConfigError) if metrics else {}
        writer = self._writer(step, metrics)  # a step no manifest can record raises here
        start = time.perf_counter()
        self._finish_previous()  # block the next save only until the previous flush is done
        self._raise_failure()
        if not self.async_save:
            self._relieve_disk_pressure()
            try:
                dcp_save(state, storage_writer=writer, process_group=self.group)
            except (Exception, CheckpointException) as err:  # a BaseException, in DCP
                self._failed(step, err)
                self._raise_failure()
                raise
            self._committed(step, None)
        elif self.overlap_staging:
            # Even starting an async save costs tens of ms in DCP (flattening the state,
            # planning); the manager's own thread pays that too, with the copy after it.
            staged: Future[None] = Future()
            self._staging, self._pending = staged, Future()
            self._submitter().submit(self._start_guarded, step, state, writer, staged, self._pending)
        else:
            staged = Future()
            self._staging, self._pending = staged, Future()
            self._start_async(step, state, writer, staged, self._pending)
            self.wait_staged()
        self.stalls[step] = time.perf_counter() - start
        return True

    def _writer(self, step: int, metrics: Mapping[str, float]) -> TieredWriter:
        try:
            return TieredWriter(self.store, step=step, migration=self.migration,
                                node_local=self.node_local, metrics=metrics, **self.writer_options)
        except TypeError as err:  # an unknown keyword: say which options TieredWriter takes
            raise ConfigError(f"writer_options {sorted(self.writer_options)} are not all "
                              f"TieredWriter arguments: {err}") from err

    def _submitter(self) -> ThreadPoolExecutor:
        if self._thread is None:  # one thread: saves start in the order they were asked for
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierstore-save")
        return self._thread

    def _start_guarded(self, step: int, state: dict[str, Any], writer: TieredWriter,
                       staged: Future[None], settled: Future[None]) -> None:
        """:meth:`_start_async` on the manager's thread, where nothing would see an error it
        raised: whatever it raises fails the save, so no waiter on ``staged`` or ``settled``
        waits for ever."""
        try:
            self._start_async(step, state, writer, staged, settled)
        except BaseException as err:
            if not settled.done():
                self._failed(step, err)
                settled.set_result(None)
            if not staged.done():
                staged.set_exception(err)

    def _start_async(self, step: int, state: dict[str, Any], writer: TieredWriter,
                     staged: Future[None], settled: Future[None]) -> None:
        """Start DCP's async save; ``staged`` completes when the copy is taken (or failed),
        ``settled`` once the save is recorded as committed or failed."""
        kind = (AsyncCheckpointerType.PROCESS if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD)
        try:
            self._relieve_disk_pressure()
            response = dcp_async_save(state, storage_writer=writer,
                                      process_group=self.group,
                                      async_checkpointer_type=kind,
                                      async_stager=self._stager_for_save())
        except (Exception, CheckpointException) as err:  # staging or planning failed
            self._failed(step, err)
            staged.set_exception(err)
            settled.set_result(None)
            return
        if isinstance(response, AsyncSaveResponse):
            future, staging = response.upload_completion, response.staging_completion
        else:  # staged before async_save returned
            future, staging = response, None
        _chain(staging, staged)
        stager = self._stager

        # A waiter on DCP's future can wake before its done callbacks ran; waiting on
        # ``settled`` instead sees the save recorded (its failure raised by wait/close/save).
        def settle(done: Future[Any]) -> None:
            try:
                if stager is not None:  # counted before the writer could read the copy
                    self.staging_allocated[step] = stager.new_bytes
                self._committed(step, done)
            finally:
                settled.set_result(None)

        future.add_done_callback(settle)

    def _stager_for_save(self) -> ReusedStaging | None:
        if self.staging == "fresh":
            return None  # DCP's default: a stager of its own per save, closed after it
        if self._stager is None:
            self._stager = ReusedStaging(staging_options(self.async_mode))
        return self._stager

    def wait_staged(self) -> None:
        """Block until the last save's copy of the state is taken: from then on the state may
        change. ``save()`` calls this itself unless ``overlap_staging=True``.

        Raises :class:`~tierstore.errors.SaveFailed` if taking the copy failed (that save
        then failed).
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        try:
            staging.result()
        except BaseException:  # DCP fails the save with it: record and raise that
            self._finish_previous()
            self._raise_failure()
            raise

    def _finish_previous(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:  # a save can settle before its staging future does
            try:
                staging.result()
            except BaseException:  # the save fails with it: raised by _raise_failure
                pass
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # recorded by _committed, raised by _raise_failure
                pass

    def _failed(self, step: int, err: BaseException) -> None:
        failure = _save_failed(step, err)
        log.error("%s", failure)
        with self._lock:
            self.last_error = err
            self._last_failure = str(failure)
            self._saves_failed += 1
            self._unraised = failure

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._unraised = self._unraised, None
        if failure is not None:
            raise failure

    def _committed(self, step: int, future: Future[Any] | None) -> None:
        error = future.exception() if future is not None else None
        if error is not None:
            self._failed(step, error)
            return
        with self._lock:
            self._saves_ok += 1
            self._last_saved_step = step
        if self.rank == 0 or self.node_local:
            self._prune_in_background()

    @property
    def _resumes_pending(self) -> bool:
        """Whether this process finishes pending migrations it finds: the coordinator of a
        store whose hot tier holds every rank's files (node-local ones hold their node's)."""
        return self.rank == 0 and not self.node_local and self.store.cold is not None

    def _prune_in_background(self, *, prune: bool = True) -> Future[None]:
        """Run a maintenance round on a daemon thread, at most one at a time: prune (unless
        ``prune`` is false) and resume the pending migrations that round found. Commits
        that land meanwhile fold into one more round, so a slow or stalled cold tier never
        queues a round per save (and an exiting process never waits on one)."""
        with self._lock:
            if self._pruning is not None and not self._pruning.done():
                self._prune_again = self._prune_again or prune
                return self._pruning
            future: Future[None] = Future()
            self._pruning, self._prune_again = future, False

        def rounds() -> None:
            pruning = prune
            while True:
                try:
                    self._maintain(prune=pruning)
                except Exception as err:
                    log.error("pruning failed: %s", err)
                    with self._lock:
                        self._prune_errors.append(str(err))
                with self._lock:
                    if not self._prune_again:
                        future.set_result(None)
                        return
                    self._prune_again, pruning = False, True

        threading.Thread(target=rounds, name="tierstore-prune", daemon=True).start()
        return future

    def _resume_node_local(self) -> None:
        """Node-local tiers: every rank queues its own files of the checkpoints its job left
        pending, and the coordinator their commits, as the writer does after a save. Only
        the coordinator knows them (its node holds the hot manifests): one broadcast at start,
        after a look at the cold tier bounded by ``RESUME_LOOK`` seconds (a cold tier that is
        down delays the start by at most that, and nothing is resumed then)."""
        cold, rank = self.store.cold, _dist.group_rank_world(self.group)[0]
        assert cold is not None
        found: list[Manifest] = []
        if rank == 0:
            looker = threading.Thread(target=lambda: found.extend(self._pending_manifests()),
                                      name="tierstore-resume-look", daemon=True)
            looker.start()
            looker.join(RESUME_LOOK)
            if looker.is_alive():
                log.warning("the cold tier %s did not answer within %.0fs: pending migrations "
                            "are not resumed at this start", cold.label, RESUME_LOOK)
                found = []
        jobs = [(m.name, m.attempt, m.step, files_by_rank(m)) for m in found]
        if self.distributed:
            jobs = _dist.broadcast(jobs, self.group)
        migrator = migrator_for(self._hot, cold, self.migration)
        for manifest in found:  # the coordinator: its own files, then the commit
            migrator.submit_commit(manifest, rank)
        if rank != 0:
            for name, attempt, step, by_rank in jobs:
                if by_rank.get(rank):
                    migrator.submit_rank(name, attempt, step, rank, by_rank[rank])
        if jobs:
            log.info("resuming the migration of %s to %s", ", ".join(j[0] for j in jobs), cold.label)

    def _pending_manifests(self) -> list[Manifest]:
        cold = self.store.cold
        assert cold is not None
        try:
            pending = check_cold_copies(self._hot, cold).pending
        except TierstoreError as err:
            log.warning("could not look for pending migrations: %s", err)
            return []
        return [m for m in self._hot.manifests() if m.name in pending]

    def _maintain(self, *, prune: bool) -> None:
        """One round: prune, then queue the migration of every hot checkpoint the round
        found never committed in cold and no migrator of this process works on."""
        if prune:
            reports = self.prune()
            pending = [name for r in reports for name in r.pending]
        elif self._resumes_pending:
            assert self.store.cold is not None
            pending = sorted(check_cold_copies(self._hot, self.store.cold).pending)
        else:
            pending = []
        if pending and self._resumes_pending and not (self._closing or _interpreter_exiting()):
            assert self.store.cold is not None
            resume_pending(migrator_for(self._hot, self.store.cold, self.migration),
                           self._hot, pending)

    def health(self) -> Health:
        """Saves, migrations and pruning as this process knows them (never raises, never
        sends a request to a tier)."""
        now = time.time()
        statuses = [s for m in self._migrators() for s in m.status()]
        failed = tuple(s for s in statuses if s.state is MigrationState.FAILED)
        busy = [s for s in statuses if s.state in (MigrationState.PENDING, MigrationState.UPLOADING)]
        with self._lock:
            return Health(
                saves_ok=self._saves_ok, saves_failed=self._saves_failed,
                last_saved_step=self._last_saved_step,
                last_error=self._last_failure,
                migrations_pending=len(busy), migrations_failed=failed,
                migration_lag_seconds=max((now - s.created for s in busy), default=0.0),
                migration_lag_bytes=sum(s.lag_bytes for s in busy),
                prune_errors=tuple(self._prune_errors),
                quarantined=tuple(dict.fromkeys(self._quarantined)),
            )

    @property
    def _hot(self) -> Tier:
        assert self.store.hot is not None  # checked in __init__
        return self.store.hot

    def _migrators(self) -> list[Migrator]:
        hot, cold = self._hot, self.store.cold
        if cold is None:
            return []
        return [m for m in active_migrators() if (m.hot.url, m.cold.url) == (hot.url, cold.url)]

    def prune(self) -> list[PruneReport]:
        """Apply the retention policies now (the coordinator does this after each commit)."""
        reports = prune(self.store, hot_policy=self.hot_policy, cold_policy=self.cold_policy,
                        node_local=self.node_local, prune_cold=not self.node_local or self.rank == 0)
        errors = [e for r in reports for e in r.errors]
        if errors:
            with self._lock:
                self._prune_errors[:] = errors
        return reports

    def _relieve_disk_pressure(self) -> None:
        """Below the hot tier's free-space watermark, prune it beyond policy, from hot-tier
        knowledge alone: this runs before a save, where no cold request may be made. A hot
        copy goes only if the hot tier's migrated mark names the cold tier's identity (known
        once any background prune reached the cold tier), checked once in the listing the
        decision is made from and again right before its un-publish; the rest is kept."""
        if self.hot_min_free is None or (self.rank != 0 and not self.node_local):
            return
        hot, cold = self._hot, self.store.cold
        free = hot.backend.free_bytes()
        if free is None:
            return
        manifests = None  # listed only where needed: this runs before every save
        threshold = self.hot_min_free
        if threshold == "auto":
            manifests = hot.manifests()
            newest = max(manifests, key=checkpoint_order, default=None)
            threshold = int(newest.total_size * 1.1) if newest is not None else 0
        if free >= int(threshold):
            return
        manifests = hot.manifests() if manifests is None else manifests
        protect: set[str] = set()
        still_safe = None
        if cold is not None:
            cold_id = _known_store_id(cold)
            protect = {m.name for m in manifests if not marks.was_migrated(hot, m, cold_id)}

            def still_safe(manifest: Manifest) -> str | None:
                if marks.was_migrated(hot, manifest, cold_id):
                    return None
                return "no migrated mark names the cold tier"

        report = prune_tier(hot, keep_none(), protect=protect, manifests=manifests,
                            still_safe=still_safe)
        log.warning("hot tier %s below its free-space watermark (%d bytes free, want %d): "
                    "pruned %s beyond policy; kept the newest and those not known to be in "
                    "cold (%s)", hot.label, free, threshold, list(report.deleted), sorted(protect))

    # -- resuming ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        found = list_checkpoints(self.catalog)
        return [c.step for c in found if c.step is not None]

    def load_latest(self, state: dict[str, Any], *, planner: Any = None) -> int | None:
        """Load the newest checkpoint that loads verified into ``state``; its step, or ``None``
        if the store holds no checkpoint.

        The coordinator picks the checkpoint and tells every rank, so all ranks load the same
        one even if a save commits meanwhile. A checkpoint found damaged while loading is
        skipped with a warning and the next older one is loaded: its manifest invalid, or its
        ``.metadata`` or a data file missing, truncated or corrupt (a byte flipped inside a
        shard included), in every tier holding it. DCP hands every rank each rank's read
        errors, so all ranks agree to move on, and the coordinator picks the next name. The
        failed attempt may have copied some items into ``state``; the retry overwrites them.
        Any other failure raises at once (a state dict that does not match the checkpoint, a
        tier that cannot be reached); so does the newest checkpoint's error if none loads.

        ``planner`` is DCP's load planner; by default DCP's own, or, when the checkpoint was
        saved by another world size, :class:`~tierstore.resume.state.ResumePlanner` (see
        :meth:`load`).
        """
        return self.load(state, planner=planner)

    def load(self, state: dict[str, Any], *, name: str | None = None, step: int | None = None,
             planner: Any = None) -> int | None:
        """Like :meth:`load_latest`, for a chosen checkpoint (``name``/``step``) or DCP planner.

        With ``name``, exactly that checkpoint: if it is damaged the error raises. Without,
        the newest checkpoint (of ``step``, if given) that loads verified, skipping damaged
        ones as :meth:`load_latest` does.

        Under a world size other than the checkpoint's, without a ``planner``, the load goes
        through :class:`~tierstore.resume.state.ResumePlanner`: per-rank keys the checkpoint
        lacks (a ``TrainingState``'s RNG entries of new ranks) are left as they are, while
        every other key stays required; sharded tensors are resharded as DCP does. A key
        still missing then raises :class:`~tierstore.errors.ConfigError` naming the key and
        both world sizes, and how to load it, instead of DCP's bare missing-key error. A
        ``planner`` given is used as it is, at any world size.
        """
        coordinator = not self.distributed or dist.get_rank(self.group) == 0
        candidates = [name] if name is not None else []  # newest first; known to the coordinator
        if name is None:
            candidates = self._candidates(step, coordinator)
        damaged: list[CheckpointException] = []
        # The damaged ones, quarantined once an older one loads.
        set_aside: list[tuple[Manifest, CheckpointException]] = []
        while True:
            chosen = candidates[len(damaged)] if len(damaged) < len(candidates) else None
            if self.distributed:  # every rank loads what the coordinator picked
                chosen = _dist.broadcast(chosen, self.group)
            if chosen is None:
                break
            reader = TieredReader(self.store, name=chosen, node_local=self.node_local,
                                  resolve_once=True, process_group=self.group)
            world = dist.get_world_size(self.group) if self.distributed else 1
            try:
                dcp_load(state, storage_reader=reader, process_group=self.group,
                         planner=planner if planner is not None else _default_planner(reader, world))
            except CheckpointException as err:  # the same on every rank: DCP gathers failures
                _raise_if_resized(err, reader, world, chosen)
                if name is not None or not is_damage(err):
                    raise
                damaged.append(err)
                if reader.manifest is not None:
                    set_aside.append((reader.manifest, err))
                log.warning("checkpoint %s is damaged in every tier holding it, loading the next "
                            "older one instead: %s", chosen, _describe(err))
                continue
            finally:
                # dcp.load returned or raised on this rank only once no rank reads (its last
                # step is a collective), so the job's lease may go, even if planning failed
                # before the reads that would have released it.
                reader.release()
            assert reader.manifest is not None
            if coordinator:
                self._quarantine(set_aside, loaded=reader.manifest.name)
            return reader.manifest.step
        if damaged:  # nothing loads: kept as they are, for a person to look at (loudly)
            raise damaged[0]
        return None

    def _candidates(self, step: int | None, coordinator: bool) -> list[str]:
        """The checkpoints to try, newest first, known to the coordinator (others get an
        empty list); its listing's error reaches every rank, so none waits for ever on a
        coordinator that gave up (node-local with the cold tier down)."""
        found: Any = None
        if coordinator:
            try:
                found = [c.name for c in reversed(list_checkpoints(self.catalog))
                         if step is None or c.step == step]
            except Exception as err:  # raised below on every rank alike
                found = err
        if self.distributed:
            found = _dist.broadcast(found, self.group)
        if isinstance(found, BaseException):
            raise found
        return list(found) if coordinator else []

    def _quarantine(self, damaged: list[tuple[Manifest, CheckpointException]], *,
                    loaded: str) -> None:
        """Set aside each checkpoint a resume fell back past (invariant 21): its step is
        trained again and saved as a new attempt, and retention never counts it again."""
        for manifest, err in damaged:
            reason = f"a resume found it damaged in every tier holding it and loaded {loaded} " \
                     f"instead: {_describe(err)}"
            for tier in self.store.tiers:
                try:
                    here = tier.find_manifest(manifest.name)
                    if here is not None and here.attempt == manifest.attempt:
                        quarantine(tier, here, reason)
                except TierstoreError as failure:  # kept published: the next resume retries
                    log.error("could not quarantine %s in %s: %s", manifest.name, tier.label, failure)
            with self._lock:
                self._quarantined.append(manifest.name)

    def verify_resume(self, probe: Any, state: dict[str, Any], *, name: str | None = None,
                      step: int | None = None, rtol: float = 0.0, atol: float = 0.0,
                      timeout: float = 600.0, record_dir: str | None = None) -> ResumeReport:
        """Prove the newest (or a chosen) checkpoint restores ``state``: see :mod:`tierstore.resume.check`.

        Call on every rank right after :meth:`save`, before the next training step. Waits for
        the pending save to commit, then loads it in fresh processes (one per rank) built by
        ``probe`` (``"module:function"`` or the function) and returns a
        :class:`tierstore.resume.check.ResumeReport`, the same on every rank.
        """
        from tierstore.resume.check import verify_resume

        self.wait(migrations=False)
        return verify_resume(probe, state, hot=self.store, name=name, step=step,
                             node_local=self.node_local, group=self.group, rtol=rtol, atol=atol,
                             timeout=timeout, record_dir=record_dir)

    # -- lifecycle -----------------------------------------------------------------------

    def wait(self, *, migrations: bool = True, timeout: float | None = None) -> None:
        """Wait for the last save; by default also for its pruning and this process's
        migrations (up to ``timeout`` seconds in all). ``migrations=False`` waits for the
        save alone, and so never for the cold tier.

        Raises :class:`~tierstore.errors.SaveFailed` for a failed save not raised before, then
        :class:`~tierstore.errors.MigrationFailed` for checkpoints whose migration failed
        (and that the cold tier does not hold since), each once. Pruning errors are not
        raised: see :meth:`health`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._finish_previous()
        if migrations:
            with self._lock:
                pruning = self._pruning
            if pruning is not None:
                try:
                    pruning.result(_left(deadline))
                except TimeoutError:
                    log.warning("pruning still running after %ss (the cold tier is slow?)", timeout)
            await_delivery(self._migrators(), deadline)
        self._raise_failure()
        if migrations:
            failed = {name: why for name, why in self._undelivered(deadline).items()
                      if name not in self._reported and not why.startswith("still ")}
            self._reported.update(failed)
            if failed:
                raise self._migration_failed(failed)

    def close(self, *, timeout: float | None = None) -> None:
        """End the run: wait for the last save, deliver its checkpoints to the cold tier,
        prune once more, release the group (docs/design.md invariant 22).

        Everything waits against one deadline, ``timeout`` seconds from now (default: the
        manager's ``close_timeout``, 300 s), logging what it waits for; a cold tier that does
        not answer one listing within 10 s is not waited for at all. What has not reached
        the cold tier by then is stopped (nothing of it runs after close returns) and stays
        committed and pending in the hot tier; close says so at ERROR, naming each
        checkpoint and how it will be finished (the next job's manager, or
        ``tierstore migrate``), and raises :class:`~tierstore.errors.MigrationFailed` after
        releasing everything. A failed save raises :class:`~tierstore.errors.SaveFailed`
        instead (it comes first), as :meth:`wait` does.
        """
        deadline = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        failure: TierstoreError | None = None
        self._finish_previous()  # the last save (hot only: it never waits on the cold tier)
        cold = self.store.cold
        if cold is not None and any(m.pending() for m in self._migrators()):
            # A cold tier that is down is not waited for: one listing tells (a migration
            # would only find out after minutes of retries).
            why = unreachable(cold, min(PROBE_WAIT, _left(deadline) or 0.0))
            if why is not None:
                log.error("the cold tier %s is unreachable (%s): close() does not wait for its "
                          "migrations", cold.label, why)
                deadline, self._cold_down = time.monotonic(), True
        try:
            self.wait(timeout=_left(deadline))
        except SaveFailed as err:
            failure = err
        except MigrationFailed:
            pass  # named again below, with whatever else is left
        self._closing = True
        if (self.rank == 0 or self.node_local) and not self._cold_down:
            # Now that migrations drained, hot copies kept only as pending can go.
            try:  # joins a running round, which then runs one more
                self._prune_in_background().result(_left(deadline, floor=0.0))
            except TimeoutError:
                log.warning("final pruning still running at close's deadline; left to the next run")
        undelivered = self._undelivered(deadline)
        for migrator in self._migrators():
            migrator.stop(set(undelivered))  # nothing of them runs once close returns
        if undelivered:
            late = self._migration_failed(undelivered)
            log.error("%s", late)
            failure = failure or late
        self._release()
        if failure is not None:
            raise failure

    def _release(self) -> None:
        if self._thread is not None:  # idle: wait() above saw its last save settle
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._stager is not None:  # frees the staging buffers; a later save makes new ones
            self._stager.close()
            self._stager = None
        if self._owns_group and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if self._run_lock is not None:
            self._run_lock.release()

    def _undelivered(self, deadline: float | None) -> dict[str, str]:
        cold = self.store.cold
        if cold is None:
            return {}
        # Looking each one up in the cold tier: bounded even when close's time is spent, and
        # not at all in a cold tier close() found unreachable.
        lookup = 0.0 if self._cold_down else 30.0 if deadline is None else _left(deadline, floor=5.0)
        return undelivered(self._migrators(), cold, timeout=lookup)

    def _migration_failed(self, failures: dict[str, str]) -> MigrationFailed:
        assert self.store.cold is not None
        return MigrationFailed(describe(failures, self._hot, self.store.cold),
                               checkpoints=tuple(failures), errors=failures)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is on its way out already: it is the one to raise
            self.close()
        except TierstoreError as err:
            log.error("while closing on %s: %s", exc_type.__name__, err)


def _left(deadline: float | None, *, floor: float = 0.0) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), at least ``floor``."""
    return None if deadline is None else max(floor, deadline - time.monotonic())


def _interpreter_exiting() -> bool:
    return sys.is_finalizing() or getattr(threading, "_SHUTTING_DOWN", False)


def _saved_world(reader: TieredReader, world: int) -> int | None:
    """The world size that saved the checkpoint ``reader`` opened, when it is not ``world``
    (the manifest is known once DCP asked the reader for the metadata, before planning)."""
    saved = reader.manifest.world_size if reader.manifest is not None else None
    return saved if saved != world else None


@dataclass(frozen=True)
class _PerRankIfResized:
    """``ResumePlanner``'s ``optional``: per-rank keys may be absent only under a world size
    other than the checkpoint's; at the same world size every key stays required."""

    reader: TieredReader
    world: int

    def __call__(self, key: str) -> bool:
        return _saved_world(self.reader, self.world) is not None and is_per_rank_key(key)


def _default_planner(reader: TieredReader, world: int) -> ResumePlanner:
    return ResumePlanner(optional=_PerRankIfResized(reader, world))


def _raise_if_resized(err: CheckpointException, reader: TieredReader, world: int, name: str) -> None:
    """Under a new world size, DCP's "Missing key" error becomes one that says what to do."""
    saved = _saved_world(reader, world)
    failures = getattr(err, "failures", None)
    causes = [_unwrap(e) for e in failures.values()] if isinstance(failures, dict) else []
    missing = next((str(c) for c in causes if "Missing key" in str(c)), None)
    if saved is None or missing is None:
        return
    raise ConfigError(
        f"checkpoint saved by {saved} ranks cannot be loaded as it is by {world} ranks: {missing} "
        "Per-rank state must be optional under a new world size: load with planner="
        "tierstore.ResumePlanner(optional=lambda key: ...) accepting that key, or save such "
        "state under keys every world size has", checkpoint=name) from err


def _chain(source: Future[Any] | None, target: Future[None]) -> None:
    """Complete ``target`` as ``source`` completes (at once if there is none)."""
    if source is None:
        target.set_result(None)
        return

    def forward(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(None)

    source.add_done_callback(forward)


def _known_store_id(cold: Tier) -> str | None:
    """The cold tier's identity if this process already read it (no request is sent)."""
    known = getattr(cold, "_store_id", None)
    return str(known) if known is not None else None


def _describe(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (error, trace)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {_describe(_unwrap(exc))}"
                         for rank, exc in sorted(failures.items()))
    if isinstance(err, SaveFailed):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _unwrap(exc: Any) -> BaseException:
    found = exc[0] if isinstance(exc, tuple) else exc  # DCP wraps (error, traceback)
    return found if isinstance(found, BaseException) else RuntimeError(repr(found))


def _save_failed(step: int, err: BaseException) -> SaveFailed:
    failures = getattr(err, "failures", None)
    errors: dict[int | None, BaseException] = (
        {rank: _unwrap(e) for rank, e in failures.items()} if isinstance(failures, dict)
        else {None: err})
    first = next(iter(errors.values()), None)
    named = ({"checkpoint": first.checkpoint, "tier": first.tier, "file": first.file}
             if isinstance(first, TierstoreError) else {})
    # All of it as context, not attributes set afterwards: so it survives pickling (DCP's
    # PROCESS mode and worker processes pickle errors).
    failure = SaveFailed(f"checkpoint of step {step} failed: {_describe(err)}", step=step,
                         errors=errors, **named)
    failure.__cause__ = err
    return failure
