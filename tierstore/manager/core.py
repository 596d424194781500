"""``CheckpointManager``, made of parts (docs/design.md, "Module map"): it holds its
collaborators, each a class of its own module with its own state (:class:`Group`,
:class:`RunGuard`, :class:`SavePipeline`, :class:`Maintenance`, :class:`Loader`,
:class:`NoticeHandler`, :class:`Delivery`), says in which order they act, and shares no
attribute between them."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError
from typing import TYPE_CHECKING, Any, TypeVar

from tierstore.dcp.writer import TieredWriter, store_to_save
from tierstore.errors import ConfigError, MigrationFailed, SaveFailed, TierstoreError
from tierstore.format.manifest_format import check_metrics
from tierstore.lifecycle.prune import PruneReport
from tierstore.lifecycle.retention import Retention
from tierstore.manager import writable
from tierstore.manager.copies import PeerCopies
from tierstore.manager.ending import Delivery, left
from tierstore.manager.group import Group
from tierstore.manager.health import Health
from tierstore.manager.loading import Loader
from tierstore.manager.maintenance import Maintenance
from tierstore.manager.notice import NoticeHandler
from tierstore.manager.preemption import PreemptionReport, preemption_options
from tierstore.manager.removed import given, refuse_removed
from tierstore.manager.runs import RunGuard, run_of
from tierstore.manager.saving import SavePipeline
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.workers import migrator_for
from tierstore.options import ManagerOptions, PreemptionOptions, RunOptions, StagingOptions, WriterOptions
from tierstore.tiers import runlock
from tierstore.tiers.tier import Store, TierURL

if TYPE_CHECKING:
    from tierstore.resume.check import ResumeReport

__all__ = ["CheckpointManager", "DEFAULT_CLOSE_TIMEOUT"]

log = logging.getLogger(__name__)

Cadence = Callable[[int], bool]
_M = TypeVar("_M", bound="CheckpointManager")
DEFAULT_CLOSE_TIMEOUT = ManagerOptions().close_timeout  # seconds close() waits for migrations, in all


class CheckpointManager:
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
        migration: how this process migrates to the cold tier (:class:`~tierstore.MigrationOptions`).
        writer: how each save is written (:class:`~tierstore.WriterOptions`: threads,
            encoding, ...).
        staging: how the state is taken off the training loop
            (:class:`~tierstore.StagingOptions`: ``dcp.async_save`` or ``dcp.save``, thread
            or process, reused or fresh buffers, overlap).
        preemption: save on a scheduler's preemption notice (default ``True``: SIGTERM, a 30 s
            grace period; a :class:`~tierstore.PreemptionOptions` names other signals and another
            period; ``False``: off). The next ``save()`` after the signal saves that step on
            every rank and pushes it to the cold tier within the grace period; then
            :attr:`preempted` is ``True`` (:mod:`tierstore.manager.preemption`).
        run: the run it saves for and resumes: a name (``RunOptions(name)``) or a
            :class:`~tierstore.RunOptions`; ``load_latest`` then resumes only that run's checkpoints
            (:mod:`tierstore.manager.runs`). ``None`` (default): the newest, whoever saved it.
        options: what the manager itself needs beyond these
            (:class:`~tierstore.ManagerOptions`: ``close_timeout``, 300 s by default, the
            most seconds :meth:`close` waits for migrations, pruning and checks in all;
            ``process_group``, by default a new gloo group; ``redundancy``, copies of each
            checkpoint of a node-local store on other nodes, :class:`~tierstore.Replicas` or
            :class:`~tierstore.Parity`, and ``node_of``, how ranks map to nodes).

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
        run: str | RunOptions | None = None,
        preemption: PreemptionOptions | bool = True,
        staging: StagingOptions | None = None,
        writer: WriterOptions | None = None,
        migration: MigrationOptions | None = None,
        options: ManagerOptions | None = None,
        **removed: Any,
    ) -> None:
        refuse_removed(removed)
        self.run = run_of(run)
        self.retention = given("retention", retention, Retention)
        self.staging = given("staging", staging, StagingOptions)
        self.writer = given("writer", writer, WriterOptions)
        options = given("options", options, ManagerOptions)
        notice = preemption_options(preemption)
        if isinstance(save_every, int) and save_every <= 0:
            raise ConfigError(f"save_every must be positive, got {save_every}")
        self.save_every = save_every
        self.store = store_to_save(hot, cold, owner="CheckpointManager")
        self.node_local, self.migration = self.store.node_local, migration
        # Node-local hot tiers each hold some ranks' files: the cold tier is the shared catalog.
        self.catalog = Store.of_tiers(None, self.store.cold) if self.node_local else self.store
        self.close_timeout = options.close_timeout
        self._guard = RunGuard(self.run)
        self._writer(0, {})  # what only a TieredWriter checks (the environment's settings) fails here
        self._group = Group(options.process_group)
        hot_tier = self.store.hot
        assert hot_tier is not None  # store_to_save refused a store without one
        try:  # a read-only or foreign hot directory, or another run's (strict): refused, every rank
            writable.check_writable(hot_tier, self._group.group, every_rank=self.node_local)
            self._guard.check_start(hot_tier, self._group.group, self._group.distributed)
            self._copies = PeerCopies(options.redundancy, self.store, node_of=options.node_of)
        except (TierstoreError, OSError):
            self._group.release()
            raise
        self.store = self._copies.start(self.store)  # a replaced node restored from its peers
        self._maintenance = Maintenance(self.store, self.retention, self._guard, self._group, migration)
        if self.store.cold is not None:  # the exit hook waits at most close_timeout for its uploads
            migrator_for(hot_tier, self.store.cold, migration, exit_wait=self.close_timeout)
        relieve, settled = self._maintenance.relieve_disk_pressure, self._copies.settled
        self._pipeline = SavePipeline(
            self.staging, self._group, before_write=relieve, committed=self._committed, settled=settled
        )
        self._loader = Loader(self.store, self.catalog, self._guard, self._group, copies=self._copies)
        lists = self._group.rank == 0 or not self.node_local
        self._delivery = Delivery(self.store, self._maintenance.migrators, catalog=lists, copies=self._copies)
        # Another live job saving into this hot directory is warned about now, once.
        self._run_lock = runlock.acquire(hot_tier) if self._group.rank == 0 else None
        self._maintenance.start()  # a killed run's pending migrations: finished in the background
        self._notice = NoticeHandler(notice)  # last: nothing after it can fail and leave handlers

    # -- what it is ----------------------------------------------------------------------------

    @property
    def group(self) -> Any:
        """The process group of its collectives (``None`` outside ``torch.distributed``, and
        once :meth:`close` destroyed its own)."""
        return self._group.group

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def distributed(self) -> bool:
        return self._group.distributed

    @property
    def stalls(self) -> dict[int, float]:
        """Each saved step: the seconds ``save()`` blocked the caller."""
        return self._pipeline.stalls

    @property
    def staging_allocated(self) -> dict[int, int]:
        """Each saved step: the bytes of staging buffers its save allocated."""
        return self._pipeline.staging_allocated

    @property
    def last_error(self) -> BaseException | None:
        """The newest save failure's error."""
        return self._pipeline.last_error

    @property
    def preemption(self) -> PreemptionReport | None:
        """What the save on a preemption notice managed, once one ran."""
        return self._notice.report

    @property
    def preempted(self) -> bool:
        """Whether a save acted on a preemption notice: the loop should stop (it is ``True``
        on every rank after the same ``save()`` call).

        Reading it once it is ``True`` hands the end of the run to the loop: the manager no
        longer ends the process itself (module docstring, 5). A loop that never reads it
        gets the process ended at its next ``save()`` or ``close()``, or at the grace
        deadline, as the signal would have ended it without the manager.
        """
        return self._notice.preempted

    def should_save(self, step: int) -> bool:
        if self.save_every is None:
            return True
        if callable(self.save_every):
            return bool(self.save_every(step))
        return step % self.save_every == 0

    def health(self) -> Health:
        """Saves, migrations and pruning as this process knows them (never raises, never
        sends a request to a tier)."""
        statuses = [s for m in self._maintenance.migrators() for s in m.status()]
        tally = self._pipeline.tally()
        saves = (tally.ok, tally.failed, tally.last_step, tally.last_error)
        where = (self._copies.summary(), self._loader.sources)
        return Health.of(saves, statuses, self._maintenance.errors, self._loader.quarantined, *where)

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        force: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Checkpoint ``state`` as ``step`` if the cadence wants it (or ``force``); ``True`` if saved.

        Returns once the state is copied (unless ``StagingOptions(overlap=True)``): training may change
        it from then on. A synchronous save, or a copy of the state, that fails raises
        :class:`~tierstore.errors.SaveFailed` at once. If the previous (background) save
        failed, this save still goes ahead, and once it is under way (its state copied,
        unless ``overlap=True``) the previous failure is raised:
        :class:`~tierstore.errors.SaveFailed` whose ``step`` is the failed one's, not
        ``step``, so a loop that catches it and goes on misses no save (a full disk that
        frees up saves the very next step). If this save fails at
        once too, its own failure is raised instead; the earlier one stays logged and
        counted in :meth:`health`. Either way each failure is raised once.

        ``metrics`` (``{"val_loss": 0.41}``: at most 64 names, finite numbers) are recorded
        in this checkpoint's manifest, for :class:`~tierstore.lifecycle.retention.keep_best`
        and ``CheckpointInfo.metrics``; the coordinator's are the ones recorded. Invalid
        metrics raise :class:`~tierstore.errors.ConfigError` before anything is saved.
        """
        self._notice.end_if_ignored(self.close)  # a notice acted on, and the loop went on: the run ends
        since = self._notice.seen()  # every call: combined across ranks (preemption.py)
        if not (force or since is not None or self.should_save(step)):
            return False
        metrics = check_metrics(metrics, source="metrics", error=ConfigError) if metrics else {}
        if since is not None:
            return self._save_on_notice(step, state, metrics, since)
        writer = self._writer(step, metrics)  # a step no manifest can record raises here
        self._pipeline.save(step, state, writer)
        return True

    def _save_on_notice(
        self, step: int, state: dict[str, Any], metrics: Mapping[str, float], since: float
    ) -> bool:
        """The save on a preemption notice: :meth:`SavePipeline.save_on_notice`, its copies
        on other nodes waited for within the grace period."""
        grace = self._notice.close_deadline(time.monotonic() + self.close_timeout)
        copied = functools.partial(self._copies.wait, grace)
        made = functools.partial(self._writer, step, metrics)
        write = functools.partial(self._pipeline.save_on_notice, step, state, made, copied)
        self._pipeline.stalls[step] = self._notice.save(step, since, write, self._maintenance.migrators)
        return True

    def wait_staged(self) -> None:
        """Block until the last save's copy of the state is taken: from then on the state may
        change. ``save()`` calls this itself unless ``StagingOptions(overlap=True)``.

        Raises :class:`~tierstore.errors.SaveFailed` if taking the copy failed (that save
        then failed).
        """
        self._pipeline.wait_staged()

    def _writer(self, step: int, metrics: Mapping[str, float]) -> TieredWriter:
        return TieredWriter(
            self.store,
            step=step,
            migration=self.migration,
            metrics=metrics,
            run=self._guard.name,
            options=self.writer,
        )

    def _committed(self, step: int) -> None:
        """After each commit: a maintenance round (in a notice's grace period, the next run prunes)."""
        if self._maintenance.prunes and not self._notice.in_grace():
            self._maintenance.request()

    def prune(self) -> list[PruneReport]:
        """Apply the retention policies now (the coordinator does this after each commit)."""
        return self._maintenance.prune()

    # -- loading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of the store's checkpoints, oldest first; with a run name, of its own only."""
        return self._loader.steps()

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
        Any other failure raises at once (a tier that cannot be reached; a state dict that
        does not match the checkpoint, as a :class:`~tierstore.errors.ConfigError` naming the
        checkpoint, its step, run and world size); so does the newest checkpoint's error if
        none loads.

        With a run name (``CheckpointManager(run=)``), only checkpoints whose manifest names
        that run are candidates: another run's, and those of no named run, are passed over
        (named once in a warning; ``RunOptions(strict=True)``: a ``ConfigError``).

        ``planner`` is DCP's load planner; by default DCP's own, or, when the checkpoint was
        saved by another world size, :class:`~tierstore.resume.state.ResumePlanner` (see
        :meth:`load`).
        """
        return self._loader.load(state, planner=planner)

    def load(
        self, state: dict[str, Any], *, name: str | None = None, step: int | None = None, planner: Any = None
    ) -> int | None:
        """Like :meth:`load_latest`, for a chosen checkpoint (``name``/``step``) or DCP planner.

        With ``name``, exactly that checkpoint: if it is damaged the error raises. Without,
        the newest checkpoint (of ``step``, if given) that loads verified, skipping damaged
        ones as :meth:`load_latest` does. A ``name`` or ``step`` loads another run's
        checkpoint too (with a warning naming both runs); ``step`` prefers this run's own.

        Under a world size other than the checkpoint's, without a ``planner``, the load goes
        through :class:`~tierstore.resume.state.ResumePlanner`: per-rank keys the checkpoint
        lacks (a ``TrainingState``'s RNG entries of new ranks) are left as they are, while
        every other key stays required; sharded tensors are resharded as DCP does. A key
        still missing then raises :class:`~tierstore.errors.ConfigError` naming the key and
        both world sizes, and how to load it, instead of DCP's bare missing-key error. A
        ``planner`` given is used as it is, at any world size.
        """
        return self._loader.load(state, name=name, step=step, planner=planner)

    def verify_resume(
        self,
        probe: Any,
        state: dict[str, Any],
        *,
        name: str | None = None,
        step: int | None = None,
        rtol: float = 0.0,
        atol: float = 0.0,
        timeout: float = 600.0,
        record_dir: str | None = None,
    ) -> ResumeReport:
        """Prove the newest (or a chosen) checkpoint restores ``state``: see :mod:`tierstore.resume.check`.

        Call on every rank right after :meth:`save`, before the next training step. Waits for
        the pending save to commit, then loads it in fresh processes (one per rank) built by
        ``probe`` (``"module:function"`` or the function) and returns a
        :class:`tierstore.resume.check.ResumeReport`, the same on every rank.
        """
        from tierstore.resume.check import verify_resume

        self.wait(migrations=False)
        return verify_resume(
            probe,
            state,
            store=self.store,
            name=name,
            step=step,
            group=self.group,
            rtol=rtol,
            atol=atol,
            timeout=timeout,
            record_dir=record_dir,
        )

    # -- the end of a run ----------------------------------------------------------------------

    def wait(self, *, migrations: bool = True, timeout: float | None = None) -> None:
        """Wait for the last save (and its copies on other nodes, with ``redundancy``); by
        default also for its pruning and this process's migrations (up to ``timeout`` seconds
        in all). ``migrations=False`` waits for the save alone, and so never for the cold tier.

        With a ``timeout``, the wait is spent trying (docs/design.md invariant 26): a
        migration that failed for a reason another try may cure is tried again each time
        the cold tier answers, until the timeout; a cold tier that answers nothing for 10 s
        in a row is not waited for. Without one, each migration is waited for once.

        Raises :class:`~tierstore.errors.SaveFailed` for a failed save not raised before, then
        :class:`~tierstore.errors.MigrationFailed` for checkpoints whose migration failed
        and that are still pending (not the cold tier's since, nor delivered and pruned
        since), each once. Pruning errors are not raised: see :meth:`health`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pipeline.finish_previous()
        self._copies.wait(deadline)  # copies on other nodes: never the cold tier
        if migrations:
            pruning = self._maintenance.running()
            if pruning is not None:
                try:
                    pruning.result(left(deadline))
                except TimeoutError:
                    log.warning("pruning still running after %ss (the cold tier is slow?)", timeout)
            self._delivery.deliver(deadline, in_grace=self._notice.in_grace())
        self._pipeline.raise_failure()
        if migrations:
            failed = self._delivery.failed_once(deadline, in_grace=self._notice.in_grace())
            if failed is not None:
                raise failed

    def close(self, *, timeout: float | None = None) -> None:
        """End the run: wait for the last save, deliver its checkpoints to the cold tier,
        prune once more, release the group (docs/design.md invariant 22). After a save on a
        preemption notice, within what is left of its grace period, and without the prune.

        Everything waits against one deadline, ``timeout`` seconds from now (default: the
        manager's ``close_timeout``, 300 s), logging what it waits for, and the deadline is
        spent trying (invariant 26): a migration that failed for a reason another try may
        cure (the cold tier down for a while, refusing, throttling) is tried again each time
        the cold tier answers a probe. A cold tier that answers nothing for 10 s in a row is
        not waited for any longer (after a preemption notice it is, until the grace
        deadline). What has not reached the cold tier by then is stopped (nothing of it
        runs after close returns) and stays committed and pending in the hot tier; close
        says so at ERROR, naming each checkpoint and how it will be finished (the next
        job's manager, or ``tierstore migrate``), and raises
        :class:`~tierstore.errors.MigrationFailed` after releasing everything. A failed save
        raises :class:`~tierstore.errors.SaveFailed` instead (it comes first), as
        :meth:`wait` does.

        A signal that comes during close(), or after the last save, bounds it by its grace
        period from then on. A preemption notice the loop did not take over (it never read
        ``preempted`` once the notice's save had returned) ends the process once close is
        done, as the signal would have without the manager (docs/training-state.md).
        """
        with self._notice.acting():  # a preemption watchdog waits for it
            self._close(timeout)

    def _close(self, timeout: float | None) -> None:
        """``close()``, with the watchdog waiting."""
        ends = time.monotonic() + (self.close_timeout if timeout is None else timeout)
        notice, delivery = self._notice, self._delivery

        def deadline_now() -> float:  # a signal that comes during close() shortens it
            return notice.close_deadline(ends)

        failure: TierstoreError | None = None
        self._pipeline.finish_previous()  # the last save (hot only: it never waits on the cold tier)
        self._copies.wait(deadline_now())  # its copies verified on the other nodes, cold tier or not
        if delivery.deliver(deadline_now, in_grace=notice.in_grace()) is not None:
            ends, delivery.cold_down = time.monotonic(), True
        deadline = deadline_now()
        try:
            self.wait(timeout=left(deadline))
        except SaveFailed as err:
            failure = err
        except MigrationFailed:
            pass  # named again below, with whatever else is left
        self._maintenance.closing = True
        deadline = deadline_now()
        if self._maintenance.prunes and not delivery.cold_down and not notice.in_grace():
            # Now that migrations drained, hot copies kept only as pending can go.
            try:  # joins a running round, which then runs one more
                self._maintenance.request().result(left(deadline, floor=0.0))
            except TimeoutError:
                log.warning("final pruning still running at close's deadline; left to the next run")
        undelivered = delivery.undelivered(deadline_now(), in_grace=notice.in_grace())
        delivery.stop(set(undelivered))  # nothing of them runs once close returns
        if undelivered:
            late = delivery.failed(undelivered)
            log.error("%s", late)
            failure = failure or late
        self._release()
        notice.end_process_if_signalled()  # a notice the loop did not take over: as the signal would
        if failure is not None:
            raise failure

    def _release(self) -> None:
        self._pipeline.release()
        self._copies.release()
        self._group.release()
        if self._run_lock is not None:
            self._run_lock.release()
        self._notice.release()

    def __enter__(self: _M) -> _M:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is on its way out already: it is the one to raise
            self.close()
        except TierstoreError as err:
            log.error("while closing on %s: %s", exc_type.__name__, err)
