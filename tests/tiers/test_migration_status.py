"""The tiers' view of migration (tierstore.migration.status): waiting for migrations, and
finishing pending ones with progress."""

from __future__ import annotations

from pathlib import Path

from helpers import save

from tierstore import Store
from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.migration.status import migrate_pending, migration_status, wait_for_migrations

QUICK = MigrationOptions(chunk_size=4096, poll_interval=0.01)  # nothing fails here: default retries


def roots(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "hot"), str(tmp_path / "cold")


def test_wait_gives_back_what_is_still_pending_when_the_timeout_runs_out(tmp_path: Path) -> None:
    hot, cold = roots(tmp_path)
    save(hot, 1)  # hot only: no migrator will ever move it
    [status] = wait_for_migrations(Store.of(hot, cold), timeout=0.2, poll=0.05)
    assert status.state is MigrationState.PENDING and status.lag_bytes == status.bytes_total > 0


def test_wait_returns_once_every_checkpoint_is_committed(tmp_path: Path) -> None:
    hot, cold = roots(tmp_path)
    for step in (1, 2):
        save(hot, step, cold, migration=QUICK)
    final = wait_for_migrations(Store.of(hot, cold), timeout=60, poll=0.01)
    assert [(s.step, s.state) for s in final] == [
        (1, MigrationState.COMMITTED),
        (2, MigrationState.COMMITTED),
    ]
    assert migration_status(Store.of(hot, cold)) == final


def test_migrate_pending_reports_progress_up_to_the_total(tmp_path: Path) -> None:
    hot, cold = roots(tmp_path)
    save(hot, 1)
    seen: list[tuple[str, int, int]] = []
    [result] = migrate_pending(Store.of(hot, cold), config=QUICK, progress=lambda *a: seen.append(a))
    assert result.state is MigrationState.COMMITTED and result.rank is None
    assert result.bytes_done == result.bytes_total > 0
    assert {name for name, _, _ in seen} == {"step-0000000001"}
    done = [d for _, d, _ in seen]
    assert done == sorted(done) and seen[-1][1:] == (result.bytes_total, result.bytes_total)
    assert [s.state for s in migration_status(Store.of(hot, cold))] == [MigrationState.COMMITTED]
