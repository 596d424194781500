"""Re-verify stored checkpoints: every byte against its manifest, every item against its file.

For each committed checkpoint of each tier: its manifest (a two-level one's parts are read
here), then ``.metadata``, verified and checked as a reader checks it (each tensor's chunks
tile it, each ``RawItem`` is what its chunk says, no two items share a byte:
:func:`tierstore.format.safe_pickle.load_metadata`), then every file read whole against its
size and CRC32C, each of its items inside it and, raw encoding, each block CRC32C over exactly
the item's bytes, in that same pass. Loads check only the blocks they read (docs/design.md
invariant 5); this is where the rest is checked. A damaged checkpoint is reported file by
file and the next one is checked (invariant 6).

Verify runs beside a live job, whose prunes delete checkpoints it listed. A file gone because
its checkpoint was un-published is not damage: where a file (or a part, or ``.metadata``) is
missing, the tier is asked again whether it still commits that attempt, and if not, those
files are reported ``pruned``, not damaged. Prune un-publishes before it deletes (invariant
14), so a file found missing while the same attempt is still published afterwards was missing
from a committed checkpoint: damage. Verify takes no lease (a reader's, invariant 16): it
would make a read-only command write to every tier, keep a pruned checkpoint's data until it
expires, and verifying a checkpoint that is being deleted tells nobody anything. Fault point
``verify.after_listing`` lies between a tier's listing and its reads.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tierstore.errors import IntegrityError, InvalidManifest, ObjectNotFound, TierstoreError
from tierstore.format.manifest import FileEntry, Manifest, checkpoint_order
from tierstore.format.verified import CHUNK, open_verified, verify_file
from tierstore.progress import counting
from tierstore.storage import faults
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["FileCheck", "verify_store"]

_Items = dict[str, list[tuple[str, Any]]]  # file -> (fqn, storage info) in file order
_Progress = Callable[[int], None] | None
_PRUNED = "un-published while verify read it (pruned, or its name committed again): not checked"


@dataclass(frozen=True)
class FileCheck:
    """One file of one checkpoint in one tier: ``ok`` unless damaged (``problem`` says how).

    ``pruned``: the checkpoint was un-published while verify read it and this file was gone
    by then; it was not checked, and that is not damage (``ok`` is true).
    """

    tier: str
    checkpoint: str
    file: str
    ok: bool
    problem: str | None = None
    size: int = 0
    pruned: bool = False


def verify_store(
    store: Store | TierURL,
    *,
    names: Iterable[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[FileCheck]:
    """Read back every file of every (or the named) committed checkpoint in every tier.

    An invalid manifest (a two-level one's part missing or altered included) is reported as
    a failed check of the file ``<manifest>``; the other checkpoints are still checked. Files
    of a checkpoint un-published while they were read are ``pruned`` (module docstring).
    """
    wanted = set(names) if names is not None else None
    results: list[FileCheck] = []
    for tier in Store.of(store).tiers:
        manifests, invalid = tier.scan_manifests()
        faults.point("verify.after_listing")
        for err in invalid:
            if wanted is None or err.checkpoint in wanted:
                results.append(FileCheck(tier.label, err.checkpoint or "?", "<manifest>", False, str(err)))
        for manifest in sorted(manifests, key=checkpoint_order):
            if wanted is None or manifest.name in wanted:
                results += _verify_checkpoint(tier, manifest, progress)
    return results


def _verify_checkpoint(
    tier: Tier, manifest: Manifest, progress: Callable[[str, int, int], None] | None
) -> list[FileCheck]:
    gone: set[str] = set()  # files found missing: damage only if the attempt is still committed
    checks = _checks(tier, manifest, progress, gone)
    if gone and _unpublished(tier, manifest):
        return [replace(c, ok=True, problem=_PRUNED, pruned=True) if c.file in gone else c for c in checks]
    return checks


def _checks(
    tier: Tier, manifest: Manifest, progress: Callable[[str, int, int], None] | None, gone: set[str]
) -> list[FileCheck]:
    try:
        files = manifest.files  # a two-level manifest reads its parts here
    except TierstoreError as err:  # this checkpoint's, reported; the next is checked
        if isinstance(err.__cause__, ObjectNotFound):
            gone.add("<manifest>")
        return [FileCheck(tier.label, manifest.name, "<manifest>", False, str(err))]
    tick = counting(f"{tier.role} {manifest.name}", manifest.total_size, progress)
    meta = next(f for f in files if f.path == manifest.metadata_file)  # validated: listed once
    meta_check, items = _check_metadata(tier, manifest, meta, {f.path for f in files}, tick, gone)
    return [
        meta_check
        if entry is meta
        else _check_file(tier, manifest, entry, items.get(entry.path, ()), tick, gone)
        for entry in files
    ]


def _unpublished(tier: Tier, manifest: Manifest) -> bool:
    """Whether ``tier`` no longer commits ``manifest``'s attempt, read now (after the reads
    that found its files missing: prune un-publishes first, invariant 14)."""
    try:
        return not tier.holds(manifest)
    except TierstoreError:  # cannot tell (unreadable, or torn now): what was found stands
        return False


def _check_metadata(
    tier: Tier, manifest: Manifest, entry: FileEntry, listed: set[str], progress: _Progress, gone: set[str]
) -> tuple[FileCheck, _Items]:
    """``.metadata`` verified and loaded as a reader loads it; its items by file."""
    from tierstore.format.safe_pickle import load_metadata  # torch: `tierstore` starts without it

    key = tier.file_key(manifest.name, manifest.attempt, entry.path)
    try:
        data = bytearray()
        with open_verified(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label) as stream:
            # In chunks, never past its recorded size: the size is the manifest's, not the file's.
            while len(data) <= entry.size and (chunk := stream.read(min(CHUNK, entry.size + 1 - len(data)))):
                data += chunk
            stream.finish()
        if progress is not None:
            progress(len(data))
        metadata = load_metadata(bytes(data))
    except TierstoreError as err:
        if isinstance(err, ObjectNotFound):
            gone.add(entry.path)
        return _failed(tier, manifest, entry, str(err)), {}
    except pickle.UnpicklingError as err:
        problem = _problem(
            IntegrityError, f"DCP metadata cannot be loaded safely: {err}", tier, manifest, entry
        )
        return _failed(tier, manifest, entry, problem), {}
    items: _Items = {}
    for index, info in metadata.storage_data.items():
        items.setdefault(info.relative_path, []).append((index.fqn, info))
    for found in items.values():
        found.sort(key=lambda item: (item[1].offset, item[1].length))
    unlisted = sorted(set(items) - listed)
    if unlisted:
        message = f"DCP metadata stores items in files the manifest does not list: {unlisted}"
        return _failed(
            tier, manifest, entry, _problem(InvalidManifest, message, tier, manifest, entry)
        ), items
    return FileCheck(tier.label, manifest.name, entry.path, True, None, entry.size), items


def _check_file(
    tier: Tier,
    manifest: Manifest,
    entry: FileEntry,
    items: Sequence[tuple[str, Any]],
    progress: _Progress,
    gone: set[str],
) -> FileCheck:
    key = tier.file_key(manifest.name, manifest.attempt, entry.path)
    problem = _item_problem(items, entry.size)
    blocks = _Blocks(items) if problem is None else None
    try:
        verify_file(
            tier.backend,
            key,
            entry,
            checkpoint=manifest.name,
            tier=tier.label,
            progress=progress,
            inspect=None if blocks is None else blocks.feed,
        )
    except TierstoreError as err:  # damaged, missing or unreadable: all reported, none fatal
        if isinstance(err, ObjectNotFound):
            gone.add(entry.path)
        return _failed(tier, manifest, entry, str(err))
    problem = problem or (blocks.problem if blocks is not None else None)
    if problem is not None:  # the bytes are the manifest's: the metadata does not match them
        return _failed(
            tier,
            manifest,
            entry,
            str(IntegrityError(problem, checkpoint=manifest.name, file=entry.path, tier=tier.label)),
        )
    return FileCheck(tier.label, manifest.name, entry.path, True, None, entry.size)


def _failed(tier: Tier, manifest: Manifest, entry: FileEntry, problem: str) -> FileCheck:
    return FileCheck(tier.label, manifest.name, entry.path, False, problem, entry.size)


def _problem(
    kind: type[TierstoreError], message: str, tier: Tier, manifest: Manifest, entry: FileEntry
) -> str:
    """``message`` as error ``kind`` words it, naming the checkpoint, file and tier."""
    return str(kind(message, checkpoint=manifest.name, file=entry.path, tier=tier.label))


def _item_problem(items: Sequence[tuple[str, Any]], size: int) -> str | None:
    """What makes an item of a file of ``size`` bytes inconsistent with it, as the reader
    checks the items it reads (raw_read.read_unit), here for every item."""
    from tierstore.format.encoding import RawItem, check_item

    for fqn, info in items:
        if isinstance(info, RawItem):
            problem = check_item(info, size)
        elif info.offset + info.length > size:
            problem = f"item ends at byte {info.offset + info.length}, past the end of the file"
        else:
            problem = None
        if problem is not None:
            return f"DCP metadata of item {fqn!r} is inconsistent: {problem}"
    return None


class _Blocks:
    """The raw encoding's block CRC32Cs, over exactly each item's bytes, as the file streams
    by in order (items sorted and disjoint: checked with ``.metadata``)."""

    def __init__(self, items: Sequence[tuple[str, Any]]) -> None:
        from tierstore.format.encoding import RawItem

        self._items = [(fqn, i) for fqn, i in items if isinstance(i, RawItem) and i.length]
        self._next = self._block = self._crc = 0  # the item, its block, that block's CRC so far
        self.problem: str | None = None

    def feed(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        while self.problem is None and self._next < len(self._items):
            fqn, item = self._items[self._next]
            lo, hi = item.block_span(self._block)
            start, stop = item.offset + lo, item.offset + hi
            if start >= end:
                return
            a, b = max(start, offset), min(stop, end)
            self._crc = crc32c_update(self._crc, data[a - offset : b - offset])
            if b < stop:
                return  # the block goes on in the next chunk
            if self._crc != item.crc32c[self._block]:
                self.problem = (
                    f"block {self._block} of item {fqn!r} (bytes {start} to {stop}) "
                    f"has CRC32C {self._crc:08x}, its RawItem records "
                    f"{item.crc32c[self._block]:08x}: DCP metadata does not match the data"
                )
            self._crc, self._block = 0, self._block + 1
            if self._block == item.blocks:
                self._next, self._block = self._next + 1, 0
