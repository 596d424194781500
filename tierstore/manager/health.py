"""What a :class:`~tierstore.manager.CheckpointManager` knows of its saves, migrations and
pruning (``manager.health()``: no request to any tier)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierstore.migration.migrator import MigrationState, MigrationStatus

__all__ = ["Health"]


@dataclass(frozen=True)
class Health:
    """What a :class:`CheckpointManager` knows of its saves, migrations and pruning.

    ``ok`` is false while any save or migration has failed, pruning reported an error, or
    copies on other nodes failed (``copies["errors"]``).
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
    # Copies on other nodes (ManagerOptions(redundancy=)): the scheme, each checkpoint's
    # verified copies as this process knows them, what a restore at start moved and from
    # where, and why copies failed; empty without redundancy.
    copies: dict[str, Any] = field(default_factory=dict)
    # Where this rank's last load read each file from ("hot", "peer", "cold").
    load_sources: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.saves_failed or self.migrations_failed or self.prune_errors or self.copies.get("errors")
        )

    @classmethod
    def of(
        cls,
        saves: tuple[int, int, int | None, str | None],
        migrations: Sequence[MigrationStatus],
        prune_errors: tuple[str, ...],
        quarantined: tuple[str, ...],
        copies: dict[str, Any] | None = None,
        load_sources: dict[str, str] | None = None,
    ) -> Health:
        """``saves`` (committed, failed, the last step saved, the newest failure), this
        process's ``migrations``, and what pruning and resumes reported, as of now."""
        now = time.time()
        failed = tuple(s for s in migrations if s.state is MigrationState.FAILED)
        busy = [s for s in migrations if s.state in (MigrationState.PENDING, MigrationState.UPLOADING)]
        return cls(
            *saves,
            migrations_pending=len(busy),
            migrations_failed=failed,
            migration_lag_seconds=max((now - s.created for s in busy), default=0.0),
            migration_lag_bytes=sum(s.lag_bytes for s in busy),
            prune_errors=prune_errors,
            quarantined=quarantined,
            copies=dict(copies or {}),
            load_sources=dict(load_sources or {}),
        )
