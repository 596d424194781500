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
own, so its collectives never interleave with training's. The next save waits only for the
previous flush. After each commit the coordinator prunes in the background, so slow object
store deletes never stall a save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore.catalog import CheckpointInfo, TierURL, list_checkpoints, make_tiers
from tierstore.errors import ConfigError
from tierstore.migrator import MigrationConfig, active_migrators
from tierstore.prune import PruneReport, pending_in_cold, prune_node_local, prune_tier
from tierstore.reader import TieredReader
from tierstore.retention import DEFAULT_COLD, DEFAULT_HOT, Policy, keep_none
from tierstore.writer import TieredWriter

if TYPE_CHECKING:
    from tierstore.verify import ResumeReport

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

Cadence = Callable[[int], bool]


class CheckpointManager:
    """Save every ``save_every`` steps, resume from the newest checkpoint, keep tiers pruned.

    Args:
        hot, cold: the store's tiers.
        hot_policy / cold_policy: retention per tier (defaults: hot keeps the last 2, cold the
            last 3; add milestones with ``keep_last(3) | keep_every(1000)``).
        save_every: an int (every N steps), a callable ``step -> bool`` (e.g. a
            :class:`tierstore.cadence.TimeCadence`), or ``None`` to save whenever asked.
        async_save: save with ``dcp.async_save`` (default) or ``dcp.save``.
        async_mode: ``"thread"`` or ``"process"`` (DCP's checkpointer types).
        node_local: the hot tier is per node (see ``TieredReader``).
        hot_min_free: before each save, if the hot tier has less free space than this many
            bytes (``"auto"``: 1.1x the newest checkpoint), prune down to what the invariants
            force (the newest, and checkpoints not yet in cold) and warn.
        process_group: group for checkpoint collectives; by default a new gloo group.
        writer_options: extra ``TieredWriter`` arguments (``thread_count``, ...).
    """

    def __init__(
        self,
        hot: TierURL,
        cold: TierURL | None = None,
        *,
        hot_policy: Policy | None = None,
        cold_policy: Policy | None = None,
        save_every: int | Cadence | None = None,
        async_save: bool = True,
        async_mode: str = "thread",
        hot_options: Mapping[str, Any] | None = None,
        cold_options: Mapping[str, Any] | None = None,
        node_local: bool = False,
        migration: MigrationConfig | None = None,
        hot_min_free: int | str | None = "auto",
        process_group: Any = None,
        writer_options: Mapping[str, Any] | None = None,
    ) -> None:
        if async_mode not in ("thread", "process"):
            raise ConfigError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
        if isinstance(save_every, int) and save_every <= 0:
            raise ConfigError(f"save_every must be positive, got {save_every}")
        self.hot, self.cold = hot, cold
        self.hot_options, self.cold_options = dict(hot_options or {}), dict(cold_options or {})
        self.tiers = {t.role: t for t in make_tiers(hot, cold, hot_options=hot_options,
                                                    cold_options=cold_options)}
        self.hot_policy = hot_policy or DEFAULT_HOT
        self.cold_policy = cold_policy or DEFAULT_COLD
        self.save_every = save_every
        self.async_save = async_save
        self.async_mode = async_mode
        self.node_local = node_local
        self.migration = migration
        self.hot_min_free = hot_min_free
        self.writer_options = dict(writer_options or {})
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self._owns_group = process_group is None and self.distributed
        self.group = dist.new_group(backend="gloo") if self._owns_group else process_group
        self._pending: Future[Any] | None = None
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="tierstore-prune")
        self._prunes: list[Future[list[PruneReport]]] = []
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None
        self.stalls: dict[int, float] = {}  # step -> seconds the caller was blocked by save()

    # -- cadence -------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        if self.save_every is None:
            return True
        if callable(self.save_every):
            return bool(self.save_every(step))
        return step % self.save_every == 0

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Checkpoint ``state`` as ``step`` if the cadence wants it (or ``force``); ``True`` if saved."""
        if not (force or self.should_save(step)):
            return False
        start = time.perf_counter()
        self._finish_previous()  # block the next save only until the previous flush is done
        self._relieve_disk_pressure()
        writer = TieredWriter(self.hot, self.cold, step=step, hot_options=self.hot_options,
                              cold_options=self.cold_options, migration=self.migration,
                              node_local=self.node_local, **self.writer_options)
        if self.async_save:
            kind = (AsyncCheckpointerType.PROCESS if self.async_mode == "process"
                    else AsyncCheckpointerType.THREAD)
            response = dcp_async_save(state, storage_writer=writer, process_group=self.group,
                                      async_checkpointer_type=kind)
            future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            self._pending = future
            future.add_done_callback(lambda f: self._committed(step, f))
        else:
            dcp_save(state, storage_writer=writer, process_group=self.group)
            self._committed(step, None)
        self.stalls[step] = time.perf_counter() - start
        return True

    def _finish_previous(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as err:  # already logged by _committed
                self.last_error = err

    def _committed(self, step: int, future: Future[Any] | None) -> None:
        error = future.exception() if future is not None else None
        if error is not None:
            self.last_error = error
            log.error("checkpoint of step %d failed: %s", step, error)
            return
        if self.rank == 0 or self.node_local:
            with self._lock:
                self._prunes.append(self._pruner.submit(self.prune))

    def prune(self) -> list[PruneReport]:
        """Apply the retention policies now (the coordinator does this after each commit)."""
        hot, cold = self.tiers["hot"], self.tiers.get("cold")
        reports = []
        if self.node_local and cold is not None:
            reports.append(prune_node_local(hot, cold, self.hot_policy))
            if self.rank == 0:
                reports.append(prune_tier(cold, self.cold_policy))
            return reports
        protect = pending_in_cold(hot, cold) if cold is not None else set()
        reports.append(prune_tier(hot, self.hot_policy, protect=protect))
        if cold is not None:
            reports.append(prune_tier(cold, self.cold_policy))
        return reports

    def _relieve_disk_pressure(self) -> None:
        if self.hot_min_free is None or (self.rank != 0 and not self.node_local):
            return
        hot, cold = self.tiers["hot"], self.tiers.get("cold")
        free = hot.backend.free_bytes()
        if free is None:
            return
        threshold = self.hot_min_free
        if threshold == "auto":
            newest = max(hot.manifests(), key=lambda m: (m.step or -1, m.created), default=None)
            threshold = int(newest.total_size * 1.1) if newest is not None else 0
        if free >= int(threshold):
            return
        protect = pending_in_cold(hot, cold) if cold is not None else set()
        report = prune_tier(hot, keep_none(), protect=protect)
        log.warning("hot tier %s below its free-space watermark (%d bytes free, want %d): "
                    "pruned %s beyond policy; kept the newest and those pending cold (%s)",
                    hot.label, free, threshold, list(report.deleted), sorted(protect))

    # -- resuming ------------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (by cold manifest in node-local mode)."""
        if self.node_local:
            found = list_checkpoints(None, self.cold, cold_options=self.cold_options)
        else:
            found = list_checkpoints(self.hot, self.cold, hot_options=self.hot_options,
                                     cold_options=self.cold_options)
        return found[-1] if found else None

    def steps(self) -> list[int]:
        found = list_checkpoints(None if self.node_local else self.hot, self.cold,
                                 hot_options=self.hot_options, cold_options=self.cold_options)
        return [c.step for c in found if c.step is not None]

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint into ``state``; its step, or ``None`` if there is none.

        The coordinator picks the checkpoint and tells every rank, so all ranks load the same
        one even if a save commits meanwhile.
        """
        info = self.latest()
        name = info.name if info is not None else None
        if self.distributed:
            box = [name]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
            name = box[0]
        if name is None:
            return None
        reader = TieredReader(self.hot, self.cold, name=name, hot_options=self.hot_options,
                              cold_options=self.cold_options, node_local=self.node_local)
        dcp_load(state, storage_reader=reader, process_group=self.group)
        assert reader.manifest is not None
        return reader.manifest.step

    def load(self, state: dict[str, Any], *, name: str | None = None, step: int | None = None,
             planner: Any = None) -> int | None:
        """Like :meth:`load_latest`, for a chosen checkpoint (``name``/``step``) or DCP planner.

        ``planner=tierstore.state.ResumePlanner()`` resumes a ``TrainingState`` under a larger
        world size, whose new ranks have no RNG entry of their own in the checkpoint.
        """
        chosen = name
        if chosen is None:
            found = [c for c in list_checkpoints(None if self.node_local else self.hot, self.cold,
                                                 hot_options=self.hot_options, cold_options=self.cold_options)
                     if step is None or c.step == step]
            chosen = found[-1].name if found else None
        if self.distributed:  # every rank loads what the coordinator picked
            box = [chosen]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
            chosen = box[0]
        if chosen is None:
            return None
        reader = TieredReader(self.hot, self.cold, name=chosen, hot_options=self.hot_options,
                              cold_options=self.cold_options, node_local=self.node_local)
        dcp_load(state, storage_reader=reader, process_group=self.group, planner=planner)
        assert reader.manifest is not None
        return reader.manifest.step

    def verify_resume(self, probe: Any, state: dict[str, Any], *, name: str | None = None,
                      step: int | None = None, rtol: float = 0.0, atol: float = 0.0,
                      timeout: float = 600.0, record_dir: str | None = None) -> ResumeReport:
        """Prove the newest (or a chosen) checkpoint restores ``state``: see :mod:`tierstore.verify`.

        Call on every rank right after :meth:`save`, before the next training step. Waits for
        the pending save to commit, then loads it in fresh processes (one per rank) built by
        ``probe`` (``"module:function"`` or the function) and returns a
        :class:`tierstore.verify.ResumeReport`, the same on every rank.
        """
        from tierstore.verify import verify_resume

        self.wait(migrations=False)
        return verify_resume(probe, state, hot=self.hot, cold=self.cold, name=name, step=step,
                             hot_options=self.hot_options, cold_options=self.cold_options,
                             node_local=self.node_local, group=self.group, rtol=rtol, atol=atol,
                             timeout=timeout, record_dir=record_dir)

    # -- lifecycle -----------------------------------------------------------------------

    def wait(self, *, migrations: bool = True, timeout: float | None = None) -> None:
        """Wait for the last save, its pruning, and (by default) this process's migrations."""
        self._finish_previous()
        with self._lock:
            prunes, self._prunes = self._prunes, []
        for prune in prunes:
            try:
                prune.result(timeout)
            except Exception as err:
                log.error("pruning failed: %s", err)
                self.last_error = err
        if migrations:
            for migrator in active_migrators():
                migrator.wait(timeout)

    def close(self) -> None:
        """Wait for the last save and migrations, prune once more, release the group."""
        self.wait()
        if self.rank == 0 or self.node_local:
            try:  # now that migrations drained, hot copies kept only as pending can go
                self.prune()
            except Exception as err:
                log.error("final pruning failed: %s", err)
                self.last_error = err
        self._pruner.shutdown(wait=True)
        if self._owns_group and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
