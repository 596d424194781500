"""The tiers' view of migration, from any process: which hot checkpoints are still pending in
cold, finishing them now (``tierstore migrate``), and waiting until none is left.

Everything here reads the state the tiers hold (manifests, upload marks, failure marks,
"migrated" marks), so it works from a monitoring job or another node as well as from the
process that saved. The background copying itself is :mod:`tierstore.migration.migrator`.

Status lists both tiers' manifests (roots only, each parsed once by its tier: they never
change once published) and checks each checkpoint's hot migrated mark; for a checkpoint still
uploading, one listing of its upload marks (whose keys say which ranks are done) and the
parts naming those ranks' files, for the bytes done. A committed checkpoint costs the same
whatever its world size, and a call that finds nothing changed reads no manifest again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from tierstore.errors import InvalidManifest
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.migration.migrator import MigrationOptions, MigrationState, MigrationStatus, Migrator
from tierstore.migration.workers import drain
from tierstore.retry import polling
from tierstore.tiers import marks
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["migration_status", "migrate_pending", "wait_for_migrations"]


def migration_status(store: Store | TierURL) -> list[MigrationStatus]:
    """Every hot-committed checkpoint's migration state as the tiers record it (any process).

    Raises the storage error if the cold tier cannot be read at all.
    """
    hot_tier, cold_tier = Store.of(store).migration_pair()
    cold_id = marks.store_id(cold_tier)
    in_cold = _cold_manifests(cold_tier)
    return [
        _tier_status(hot_tier, cold_tier, m, time.time(), cold_id, in_cold) for m in _hot_manifests(hot_tier)
    ]


def _hot_manifests(hot: Tier) -> list[Manifest]:
    return sorted(hot.manifests(), key=checkpoint_order)


_ColdView = dict[str, "Manifest | InvalidManifest"]


def _cold_manifests(cold: Tier) -> _ColdView:
    """The cold tier's manifests by name, from one listing: valid ones, and the errors of
    invalid ones (a valid manifest wins if a name somehow has both)."""
    found, invalid = cold.scan_manifests()
    view: _ColdView = {err.checkpoint: err for err in invalid if err.checkpoint is not None}
    view.update((m.name, m) for m in found)
    return view


def _tier_status(
    hot: Tier, cold: Tier, manifest: Manifest, now: float, cold_id: str | None, in_cold: _ColdView
) -> MigrationStatus:
    total = manifest.total_size
    base = MigrationStatus(
        manifest.name,
        manifest.attempt,
        manifest.step,
        MigrationState.PENDING,
        None,
        total,
        0,
        manifest.created,
        lag_seconds=now - manifest.created,
    )
    committed = in_cold.get(manifest.name)
    if isinstance(committed, InvalidManifest):
        return replace(
            base,
            state=MigrationState.FAILED,
            error=(f"the cold manifest is invalid ({committed}); the hot copy is kept"),
        )
    if committed is not None and committed == manifest:
        if cold_id is not None and not marks.was_migrated(hot, manifest, cold_id):
            marks.mark_migrated(hot, manifest, cold_id)  # repair a mark lost after the commit
        return replace(base, state=MigrationState.COMMITTED, bytes_done=total, lag_seconds=0.0)
    if committed is None and marks.was_migrated(hot, manifest, cold_id):
        # committed in this cold tier once, pruned there since by its policy
        return replace(base, state=MigrationState.COMMITTED, bytes_done=total, lag_seconds=0.0)
    if committed is not None:
        return replace(
            base,
            state=MigrationState.FAILED,
            error=(
                f"the cold tier holds another attempt ({committed.attempt}) of this checkpoint; "
                "it is never overwritten, so this attempt stays in the hot tier only"
            ),
        )
    listing = marks.list_marks(cold, manifest.name, manifest.attempt)
    # A mark's key names the files it vouches for; one naming other files (a forged or stale
    # mark) does not count: the next migration repairs it.
    done_ranks = [
        rank
        for rank in sorted(listing.digests)
        if listing.marked(rank, marks.files_digest(manifest.files_of_rank(rank)))
    ]
    done = sum(f.size for rank in done_ranks for f in manifest.files_of_rank(rank))
    for rank in sorted(listing.failed - set(done_ranks)):
        failure = marks.read_failure(cold, manifest.name, manifest.attempt, rank)
        if failure is not None:
            return replace(
                base,
                state=MigrationState.FAILED,
                bytes_done=done,
                error=failure.get("error"),
                failed_rank=rank,
                failed_file=failure.get("file"),
            )
    state = MigrationState.UPLOADING if done_ranks else MigrationState.PENDING
    return replace(base, state=state, bytes_done=done)


def migrate_pending(
    store: Store | TierURL,
    *,
    names: Iterable[str] | None = None,
    config: MigrationOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    finished: Callable[[MigrationStatus], None] | None = None,
) -> list[MigrationStatus]:
    """Finish every pending migration now, in this process, from a hot tier holding all files.

    Ranks whose upload mark exists and files already stored intact are skipped. Returns
    each checkpoint's final status; a checkpoint's failure is reported there, not raised.
    A tier that cannot be read at all (the cold tier down) raises its storage error.
    ``progress(name, bytes_done, bytes_total)`` counts bytes the cold tier acknowledged
    storing (all of them is not yet committed: the cold manifest comes after);
    ``finished(status)`` is called as each checkpoint ends, committed or failed, so that a
    caller interrupted midway knows which are committed.
    """
    hot_tier, cold_tier = Store.of(store).migration_pair()
    migrator = Migrator(hot_tier, cold_tier, config)
    wanted = set(names) if names is not None else None
    results = []
    try:
        cold_id = marks.store_id(cold_tier)
        in_cold = _cold_manifests(cold_tier)
        for manifest in _hot_manifests(hot_tier):
            if wanted is not None and manifest.name not in wanted:
                continue
            status = _tier_status(hot_tier, cold_tier, manifest, time.time(), cold_id, in_cold)
            if status.state is MigrationState.COMMITTED:
                continue
            results.append(migrator.migrate_checkpoint(manifest, progress))
            if finished is not None:
                finished(results[-1])
    finally:
        migrator.close()
    return results


def wait_for_migrations(
    store: Store | TierURL, *, timeout: float | None = None, poll: float = 1.0
) -> list[MigrationStatus]:
    """Wait until no hot-committed checkpoint is still pending or uploading (any process).

    Returns the final statuses (``committed`` or ``failed``); on ``timeout`` the ones still
    in flight are returned as they are. Also drains this process's migrators first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    drain(timeout)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    store = Store.of(store)
    return polling(poll, left).poll(lambda: migration_status(store), until=_settled)


def _settled(statuses: list[MigrationStatus]) -> bool:
    return not any(s.state in (MigrationState.PENDING, MigrationState.UPLOADING) for s in statuses)
