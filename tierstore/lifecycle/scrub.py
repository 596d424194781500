"""Re-verify stored checkpoints: every file's size and CRC32C against its manifest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tierstore.commit.manifest import FileEntry, Manifest, checkpoint_order
from tierstore.commit.verified import verify_file
from tierstore.errors import TierstoreError
from tierstore.progress import counting
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["FileCheck", "verify_store"]


@dataclass(frozen=True)
class FileCheck:
    tier: str
    checkpoint: str
    file: str
    ok: bool
    problem: str | None = None
    size: int = 0


def _check(tier: Tier, manifest: Manifest, entry: FileEntry,
           progress: Callable[[int], None] | None) -> FileCheck:
    key = tier.file_key(manifest.name, manifest.attempt, entry.path)
    try:
        verify_file(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label,
                    progress=progress)
    except TierstoreError as err:  # damaged, missing or unreadable: all reported, none fatal
        return FileCheck(tier.label, manifest.name, entry.path, False, str(err), entry.size)
    return FileCheck(tier.label, manifest.name, entry.path, True, None, entry.size)


def verify_store(hot: TierURL | Store | None, cold: TierURL | None = None, *,
                 names: Iterable[str] | None = None, hot_options: dict[str, Any] | None = None,
                 cold_options: dict[str, Any] | None = None,
                 progress: Callable[[str, int, int], None] | None = None) -> list[FileCheck]:
    """Read back every file of every (or the named) committed checkpoint in every tier.

    An invalid manifest is reported as a failed check of the file ``<manifest>``.
    """
    wanted = set(names) if names is not None else None
    results: list[FileCheck] = []
    for tier in Store.of(hot, cold, hot_options=hot_options, cold_options=cold_options).tiers:
        manifests, invalid = tier.scan_manifests()
        for err in invalid:
            if wanted is None or err.checkpoint in wanted:
                results.append(FileCheck(tier.label, err.checkpoint or "?", "<manifest>", False, str(err)))
        for manifest in sorted(manifests, key=checkpoint_order):
            if wanted is not None and manifest.name not in wanted:
                continue
            tick = counting(f"{tier.role} {manifest.name}", manifest.total_size, progress)
            results += [_check(tier, manifest, entry, tick) for entry in manifest.files]
    return results
