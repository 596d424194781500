"""What every part of :class:`~tierstore.manager.CheckpointManager` shares: the attributes
its constructor sets (declared here, for the type checker), and the tiers and migrators it
works with."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tierstore.dcp.writer import TieredWriter
from tierstore.errors import SaveFailed
from tierstore.lifecycle.prune import PruneReport
from tierstore.lifecycle.retention import Retention
from tierstore.lifecycle.rounds import BackgroundRounds
from tierstore.migration.migrator import (
    MigrationConfig,
    Migrator,
)
from tierstore.migration.workers import migrators_of
from tierstore.options import Run, StagingOptions, WriterOptions
from tierstore.staging import ReusedStaging
from tierstore.tiers import runlock
from tierstore.tiers.tier import Store, Tier

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed.checkpoint.api import CheckpointException

    from tierstore.dcp.reader import TieredReader
    from tierstore.format.manifest import Manifest
    from tierstore.tiers.catalog import CheckpointInfo

__all__ = ["Base"]


class Base:
    """The state the manager's parts share (set by ``CheckpointManager.__init__``)."""

    store: Store
    catalog: Store
    retention: Retention
    save_every: int | Callable[[int], bool] | None
    node_local: bool
    migration: MigrationConfig | None
    close_timeout: float
    writer: WriterOptions
    staging: StagingOptions
    distributed: bool
    rank: int
    group: Any
    last_error: BaseException | None
    stalls: dict[int, float]
    staging_allocated: dict[int, int]
    _stager: ReusedStaging | None
    _staging: Future[None] | None
    _thread: ThreadPoolExecutor | None
    _owns_group: bool
    _pending: Future[None] | None
    _rounds: BackgroundRounds
    _quarantined: list[str]
    _inherited: set[str] | None
    _closing: bool
    _cold_down: bool
    _reported: set[str]
    _lock: threading.Lock
    _unraised: SaveFailed | None
    _last_failure: str | None
    _saves_ok: int
    _saves_failed: int
    _last_saved_step: int | None
    _prune_errors: list[str]
    _run_lock: runlock.RunLock | None
    run: Run | None  # the run it saves and resumes (tierstore.manager.runs)
    _runs_reported: set[str]  # the other runs already named in a warning

    if TYPE_CHECKING:  # what one part calls of another (each defined once, in its module)

        def should_save(self, step: int) -> bool: ...
        def _writer(self, step: int, metrics: Mapping[str, float]) -> TieredWriter: ...
        def _finish_previous(self) -> None: ...
        def _raise_failure(self) -> None: ...
        def _prune_in_background(self, *, prune: bool = True) -> Future[None]: ...
        def _maintain(self, *, prune: bool) -> None: ...
        def _round_failed(self, err: Exception) -> None: ...
        def _relieve_disk_pressure(self) -> None: ...
        def _resume_node_local(self) -> None: ...
        def _save_sync(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None: ...
        def _preemption_seen(self) -> float | None: ...
        def _save_on_preemption(
            self, step: int, state: dict[str, Any], metrics: Mapping[str, float], since: float
        ) -> bool: ...
        def _close_deadline(self, deadline: float) -> float: ...
        def _release_watch(self) -> None: ...
        def _in_grace(self) -> bool: ...
        def _acting(self) -> contextlib.AbstractContextManager[None]: ...
        def _end_if_notice_ignored(self) -> None: ...
        def _end_process_if_signalled(self) -> None: ...
        @property
        def preempted(self) -> bool: ...
        def prune(self) -> list[PruneReport]: ...
        def wait(self, *, migrations: bool = True, timeout: float | None = None) -> None: ...
        def close(self, *, timeout: float | None = None) -> None: ...
        def _resumable(self, listed: Sequence[CheckpointInfo], step: int | None) -> list[CheckpointInfo]: ...
        def _loaded(self, manifest: Manifest) -> None: ...
        def _raise_if_mismatched(
            self, err: CheckpointException, reader: TieredReader, planner: Any, name: str
        ) -> None: ...

    @property
    def _resumes_pending(self) -> bool:
        """Whether this process finishes pending migrations it finds: the coordinator of a
        store whose hot tier holds every rank's files (node-local ones hold their node's)."""
        return self.rank == 0 and not self.node_local and self.store.cold is not None

    @property
    def _hot(self) -> Tier:
        assert self.store.hot is not None  # checked in __init__
        return self.store.hot

    def _migrators(self) -> list[Migrator]:
        hot, cold = self._hot, self.store.cold
        if cold is None:
            return []
        return migrators_of(hot, cold)
