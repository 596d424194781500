"""Re-verify stored checkpoints: every file's size and CRC32C against its manifest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tierstore.commit.manifest import FileEntry, Manifest
from tierstore.errors import TierstoreError
from tierstore.storage.backend import crc32c_update
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["FileCheck", "verify_store"]

_CHUNK = 8 << 20


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
    crc, size = 0, 0
    try:
        with tier.backend.open_read(key) as stream:
            while chunk := stream.read(_CHUNK):
                crc = crc32c_update(crc, chunk)
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except TierstoreError as err:
        return FileCheck(tier.label, manifest.name, entry.path, False, str(err), entry.size)
    if size != entry.size:
        problem = f"size mismatch: expected {entry.size} bytes, found {size}"
    elif crc != entry.crc32c:
        problem = f"CRC32C mismatch: expected {entry.crc32c:08x}, found {crc:08x}"
    else:
        return FileCheck(tier.label, manifest.name, entry.path, True, None, entry.size)
    return FileCheck(tier.label, manifest.name, entry.path, False, problem, entry.size)


class _Ticker:
    def __init__(self, label: str, total: int,
                 progress: Callable[[str, int, int], None] | None) -> None:
        self.label, self.total, self.progress, self.done = label, total, progress, 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.label, self.done, self.total)


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
        for manifest in sorted(manifests, key=lambda m: (m.step or -1, m.name)):
            if wanted is not None and manifest.name not in wanted:
                continue
            tick = _Ticker(f"{tier.role} {manifest.name}", manifest.total_size, progress)
            results += [_check(tier, manifest, entry, tick) for entry in manifest.files]
    return results
