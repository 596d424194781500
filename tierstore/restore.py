"""Copy a checkpoint from the cold tier back to the hot tier, verified.

After a node replacement the hot tier is empty; restoring the checkpoint to resume from
turns a slow resume from object storage into a fast local one. The hot manifest is
published last, after every file is durable and verified, exactly as a save commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tierstore._transfer import copy_file, has_verified_copy
from tierstore.catalog import TierURL, make_tiers, resolve
from tierstore.errors import CheckpointExists
from tierstore.manifest import FileEntry, Manifest
from tierstore.migrator import MigrationConfig

__all__ = ["restore"]

log = logging.getLogger(__name__)


def restore(hot: TierURL, cold: TierURL, *, step: int | None = None, name: str | None = None,
            hot_options: dict[str, Any] | None = None, cold_options: dict[str, Any] | None = None,
            config: MigrationConfig | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> Manifest:
    """Restore the newest (or the given) cold checkpoint into the hot tier; return its manifest.

    Files already in the hot tier and intact are kept; damaged or partial ones are replaced.
    Restoring a checkpoint the hot tier already holds is a no-op.
    """
    config = config or MigrationConfig()
    hot_tier, cold_tier = make_tiers(hot, cold, hot_options=hot_options, cold_options=cold_options)
    manifest, _ = resolve([cold_tier], step=step, name=name)
    present = hot_tier.find_manifest(manifest.name)
    if present is not None:
        if present.attempt != manifest.attempt:
            raise CheckpointExists("the hot tier holds another attempt of this checkpoint",
                                   checkpoint=manifest.name, tier=hot_tier.label)
        return manifest
    done, total = 0, manifest.total_size

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(manifest.name, done, total)

    for entry in manifest.files:
        if has_verified_copy(hot_tier, manifest.name, manifest.attempt, entry):
            advance(entry.size)
            continue
        key = hot_tier.file_key(manifest.name, manifest.attempt, entry.path)

        def attempt(key: str = key, entry: FileEntry = entry) -> None:
            hot_tier.backend.delete(key)  # a partial or damaged copy from an earlier try
            copy_file(cold_tier, hot_tier, manifest.name, manifest.attempt, entry,
                      chunk_size=config.chunk_size, progress=advance)

        config.retry.call(attempt, what=f"restore of {entry.path} ({manifest.name})")
    try:
        hot_tier.publish_manifest(manifest)
    except CheckpointExists:
        again = hot_tier.find_manifest(manifest.name)
        if again is None or again.attempt != manifest.attempt:
            raise
    log.info("restored %s from %s to %s", manifest.name, cold_tier.label, hot_tier.label)
    return manifest
