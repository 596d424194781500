"""Whether a checkpoint's data files are all in place, from listings: what a reader without a
name checks before it picks a checkpoint, so a damaged one is skipped, not failed on.

Sizes and names only; bytes are verified while they stream (:mod:`tierstore.dcp.reader`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from tierstore.errors import ChecksumMismatch, ObjectNotFound, UnsafePath
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier

__all__ = ["check_data_files", "complete_by_listing"]


def check_data_files(
    manifest: Manifest, holders: Sequence[Tier], storage: Mapping[MetadataIndex, Any]
) -> None:
    """Raise if some data file is missing or of the wrong size in every tier in ``holders``
    (the error of the farthest tier, as a read would), or a manifest part is missing or
    unreadable.

    Listings, not a request per file: a tier whose attempt lives under known prefixes (its
    directory; on an object store, one prefix per 64 ranks: :func:`layout.attempt_prefixes`)
    is listed and, where it holds every part and every file DCP's metadata stores an item
    in and its files add up to the root's file count and bytes, vouches for every file
    without reading a manifest part (the coordinator of a 16k-rank job reads the root
    only). Otherwise each tier is listed per data prefix against the file entries
    (:func:`tierstore.tiers.marks.not_in_place`), parts loaded as needed: a part that is
    missing or altered raises its ``InvalidManifest`` here, so a reader without a name
    skips the checkpoint rather than fail its reads.
    """
    if manifest.parts and any(complete_by_listing(manifest, t, storage) for t in holders):
        return
    wanted = [f for f in manifest.files if f.path != manifest.metadata_file]
    for i, tier in enumerate(holders):
        wanted = marks.not_in_place(tier, manifest.name, manifest.attempt, wanted)
        if not wanted:
            return
        if i + 1 < len(holders):
            continue
        entry = wanted[0]
        key = tier.file_key(manifest.name, manifest.attempt, entry.path)
        try:
            size = tier.backend.stat(key).size
        except (ObjectNotFound, UnsafePath) as err:
            context = {**err.context, "checkpoint": manifest.name, "file": entry.path}
            raise type(err)(err.message, **context) from err
        if size != entry.size:
            raise ChecksumMismatch.size(
                entry.size, size, checkpoint=manifest.name, file=entry.path, tier=tier.label
            )
        raise ChecksumMismatch(
            "stored with another CRC32C than the manifest's",
            checkpoint=manifest.name,
            file=entry.path,
            tier=tier.label,
        )


def complete_by_listing(manifest: Manifest, tier: Tier, storage: Mapping[MetadataIndex, Any]) -> bool:
    """Whether one listing of the attempt shows it whole without reading a part: every
    part at its recorded size, every file DCP's metadata names at least as long as its
    last item, and totals that add up. Totals alone are not enough: a deleted shard and a
    stray file of its size would add up the same."""
    prefixes = layout.attempt_prefixes(
        manifest.name, manifest.attempt, manifest.world_size, spread=tier.backend.spread_keys
    )
    if prefixes is None:
        return False  # spread over any of 256 hashed prefixes: only the parts say where
    parts = {tier.file_key(manifest.name, manifest.attempt, ref.path): ref.size for ref in manifest.parts}
    by_path = {manifest.metadata_file: 0}
    for item in storage.values():  # O(items), from .metadata: no part needed
        by_path[item.relative_path] = max(by_path.get(item.relative_path, 0), item.offset + item.length)
    ends = {tier.file_key(manifest.name, manifest.attempt, path): end for path, end in by_path.items()}
    count = size = 0
    for info in (i for prefix in prefixes for i in tier.backend.list(prefix)):
        if layout.is_temporary(info.key):
            continue
        if layout.is_manifest_part(info.key):
            if parts.pop(info.key, None) != info.size:
                return False
            continue
        end = ends.pop(info.key, None)
        if end is not None and info.size < end:
            return False
        count, size = count + 1, size + info.size
    return not parts and not ends and count == manifest.num_files and size == manifest.total_size
