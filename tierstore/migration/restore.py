"""Copy a checkpoint from the cold tier back to the hot tier, verified; repair a damaged one.

After a node replacement the hot tier is empty; restoring the checkpoint to resume from
turns a slow resume from object storage into a fast local one. The hot manifest is
published last, after every file is durable and verified, exactly as a save commits.

Restoring a checkpoint the hot tier already holds repairs it: every hot file is verified
against the manifest (size, CRC32C) and each missing, truncated or corrupt one is replaced by
a verified cold copy. A copy replaces the damaged file whole (backend writes are atomic), so
nothing is deleted first and a concurrent load sees either the old bytes or the new ones. A
hot manifest that is itself damaged is replaced by the cold one once every file is good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    InvalidManifest,
    ObjectNotFound,
    StorageError,
)
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.transfer import Throttle, check_copy, copy_file
from tierstore.progress import counting
from tierstore.tiers.catalog import resolve
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["restore", "restore_checkpoint", "RestoreReport", "Repair"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Repair:
    """A file of the hot copy that was replaced, and what was wrong with it."""

    path: str
    problem: str


@dataclass(frozen=True)
class RestoreReport:
    manifest: Manifest
    copied: tuple[str, ...]  # every file copied from cold
    repaired: tuple[Repair, ...]  # files the hot tier held damaged, or lacked while committed
    manifest_repaired: bool = False  # the hot manifest was damaged and has been replaced


def restore(
    store: Store | TierURL,
    *,
    step: int | None = None,
    name: str | None = None,
    config: MigrationOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Manifest:
    """Restore (or repair) the newest (or the given) cold checkpoint in the hot tier; return
    its manifest. :func:`restore_checkpoint` also says what was copied and repaired."""
    return restore_checkpoint(store, step=step, name=name, config=config, progress=progress).manifest


def restore_checkpoint(
    store: Store | TierURL,
    *,
    step: int | None = None,
    name: str | None = None,
    config: MigrationOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> RestoreReport:
    """Restore the newest (or the given) cold checkpoint into the hot tier, repairing what the
    hot tier holds of it (module docstring); raise :class:`CheckpointExists` if the hot tier
    commits another attempt under that name."""
    config = config or MigrationOptions()
    hot_tier, cold_tier = Store.of(store).migration_pair()
    manifest, _ = resolve([cold_tier], step=step, name=name)
    present, torn = _hot_manifest(hot_tier, manifest.name)
    if present is not None and present.attempt != manifest.attempt:
        raise CheckpointExists(
            "the hot tier holds another attempt of this checkpoint",
            checkpoint=manifest.name,
            tier=hot_tier.label,
        )
    advance = counting(manifest.name, manifest.total_size, progress)
    advance(0)  # started: the bar shows before the first file is stored
    throttle = Throttle(config.bandwidth)  # `tierstore restore --bandwidth` (it had none)
    copied: list[str] = []
    repaired: list[Repair] = []
    for entry in manifest.files:
        problem = _problem(hot_tier, manifest, entry)
        if problem is None:
            advance(entry.size)
            continue
        if present is not None or torn is not None or problem != "missing":
            log.warning(
                "repairing %s of checkpoint %s in %s from %s: %s",
                entry.path,
                manifest.name,
                hot_tier.label,
                cold_tier.label,
                problem,
            )
            repaired.append(Repair(entry.path, problem))

        def attempt(entry: FileEntry = entry) -> None:
            # No delete first: the copy replaces a damaged file whole when it commits.
            copy_file(
                cold_tier,
                hot_tier,
                manifest.name,
                manifest.attempt,
                entry,
                chunk_size=config.chunk_size,
                throttle=throttle,
                progress=advance,
            )

        config.retry.call(attempt, what=f"restore of {entry.path} ({manifest.name})")
        copied.append(entry.path)
    if present is None:
        _publish(hot_tier, manifest, torn)
    log.info(
        "restored %s from %s to %s (%d files copied, %d repaired)",
        manifest.name,
        cold_tier.label,
        hot_tier.label,
        len(copied),
        len(repaired),
    )
    return RestoreReport(manifest, tuple(copied), tuple(repaired), manifest_repaired=torn is not None)


def _hot_manifest(hot: Tier, name: str) -> tuple[Manifest | None, InvalidManifest | None]:
    try:
        return hot.find_manifest(name), None
    except InvalidManifest as err:
        return None, err


def _problem(hot: Tier, manifest: Manifest, entry: FileEntry) -> str | None:
    """What is wrong with the hot copy of ``entry``, ``None`` if it is intact."""
    try:
        check_copy(hot, manifest.name, manifest.attempt, entry)
    except ObjectNotFound:
        return "missing"
    except ChecksumMismatch as err:
        return err.message
    except StorageError as err:  # unreadable (a link, a directory, an I/O error): replace it
        return str(err)
    return None


def _publish(hot: Tier, manifest: Manifest, torn: Exception | None) -> None:
    if torn is not None:
        # Every file is verified now; only then does the damaged manifest give way.
        log.warning("replacing the damaged manifest of %s in %s: %s", manifest.name, hot.label, torn)
        hot.backend.delete(layout.manifest_key(manifest.name))
    try:
        hot.publish_manifest(manifest)
    except CheckpointExists:
        again = hot.find_manifest(manifest.name)
        if again is None or again.attempt != manifest.attempt:
            raise
