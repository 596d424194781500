"""What a :class:`~tierstore.manager.CheckpointManager` knows of its saves, migrations and
pruning (``manager.health()``: no request to any tier)."""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.migration.migrator import MigrationStatus

__all__ = ["Health"]


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
