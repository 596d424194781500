"""Reading a committed checkpoint's files for :class:`~tierstore.dcp.reader.TieredReader`.

A dcp-encoded file is streamed and verified whole before anything in it is trusted; a
raw-encoded one is read in place, by ranges (:mod:`tierstore.dcp.raw_read`). Every file comes
from the nearest tier whose copy verifies (:func:`tierstore.dcp.fallback.read_nearest`), and
each read is counted against the tier that served it (``bytes_read``, ``sources``): the
reader's own dictionaries, filled here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from tierstore.dcp import fallback, raw_read
from tierstore.dcp.dcp_files import ItemStream, deliver
from tierstore.errors import ChecksumMismatch, InvalidManifest
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.format.verified import open_verified, verify_file
from tierstore.storage import faults
from tierstore.tiers.tier import Tier

__all__ = ["FileReads"]


class FileReads:
    """The reads of one checkpoint's files (``manifest``), from ``holders`` nearest first."""

    def __init__(
        self,
        manifest: Manifest,
        holders: list[Tier],
        storage_data: Mapping[MetadataIndex, Any],
        transforms: _StorageReaderTransforms,
        *,
        node_local: bool,
        thread_count: int,
        lock: threading.Lock,
        bytes_read: dict[str, int],
        sources: dict[str, str],
        served: dict[str, int],
    ) -> None:
        self.manifest, self._holders, self._storage_data = manifest, holders, storage_data
        self._transforms, self.node_local, self.thread_count = transforms, node_local, thread_count
        self._lock, self.bytes_read, self.sources, self._served = lock, bytes_read, sources, served

    def _entry(self, path: str) -> FileEntry:
        assert self.manifest is not None
        entry = self.manifest.file(path)
        if entry is None:
            raise InvalidManifest(
                "DCP metadata references a file the manifest does not list",
                checkpoint=self.manifest.name,
                file=path,
            )
        return entry

    def read_small(self, entry: FileEntry) -> bytes:
        """Read a whole file (``.metadata``) from the nearest tier with a verified copy."""
        chunks: list[bytes] = []

        def collect(stream: ItemStream) -> None:
            data = stream.read_exactly(entry.size)
            stream.finish()  # verified before anyone unpickles it
            chunks[:] = [data]

        self._streamed(entry, collect)
        return chunks[0]

    def read_file(self, path: str, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        entry = self._entry(path)
        spans: dict[MetadataIndex, list[ReadItem]] = {}
        for item in items:
            spans.setdefault(item.storage_index, []).append(item)
        ordered = sorted(spans.items(), key=lambda kv: self._storage_data[kv[0]].offset)

        def deliver_all(stream: ItemStream) -> None:
            failure: Exception | None = None
            for index, reqs in ordered:
                info = self._storage_data[index]
                stream.skip_to(info.offset)
                payload = stream.read_exactly(info.length)
                if failure is None:
                    try:
                        for req in reqs:
                            deliver(
                                req, payload, planner, stream, self._transforms, info.transform_descriptors
                            )
                    except Exception as err:  # corrupt bytes may break torch.load first
                        failure = err
            stream.finish()  # raises ChecksumMismatch before any deserialization error
            if failure is not None:
                raise failure

        self._streamed(entry, deliver_all)

    def _streamed(self, entry: FileEntry, consume: Callable[[ItemStream], None]) -> None:
        """Stream ``entry`` from the nearest tier whose copy verifies whole."""
        assert self.manifest is not None
        name = self.manifest.name

        def consume_tier(tier: Tier, key: str) -> None:
            with open_verified(tier.backend, key, entry, checkpoint=name, tier=tier.label) as verified:
                try:
                    consume(ItemStream(verified))
                finally:
                    self._count(tier, verified.pos)

        self._from_nearest(entry, consume_tier)

    def read_raw(self, files: Mapping[str, Sequence[ReadItem]], planner: raw_read.Planner) -> None:
        """Read raw-encoded files, ``thread_count`` units at a time (see raw_read)."""
        units = raw_read.plan(files, self._storage_data, self._entry, self.thread_count)

        def run(unit: raw_read.Unit) -> None:
            faults.point("reader.before_file")
            self._read_unit(unit, planner)

        if self.thread_count > 1 and len(units) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="tierstore-read") as pool:
                list(pool.map(run, units))
        else:
            for unit in units:
                run(unit)

    def _read_unit(self, unit: raw_read.Unit, planner: raw_read.Planner) -> None:
        assert self.manifest is not None
        name = self.manifest.name

        def consume(tier: Tier, key: str) -> None:
            label = tier.label  # once per file, not per read: it redacts the URL each time

            def opener(offset: int, length: int) -> BinaryIO:
                return tier.backend.open_range(key, offset, length)

            def count(n: int) -> None:
                self._count_as(label, n)

            try:
                raw_read.read_unit(opener, unit, planner, checkpoint=name, tier=label, count=count)
            except ChecksumMismatch:
                # Damage only: report it as the file's mismatch, the message scrub and
                # transfer give; a file that verifies whole has metadata that does not match it.
                verify_file(tier.backend, key, unit.entry, checkpoint=name, tier=label, progress=count)
                raise

        self._from_nearest(unit.entry, consume)

    def _count(self, tier: Tier, n: int) -> None:
        self._count_as(tier.label, n)

    def _count_as(self, label: str, n: int) -> None:
        with self._lock:
            self.bytes_read[label] = self.bytes_read.get(label, 0) + n

    def _from_nearest(self, entry: FileEntry, consume: Callable[[Tier, str], None]) -> None:
        """Read ``entry`` from the nearest tier whose copy verifies, falling back tier by tier
        (:func:`tierstore.dcp.fallback.read_nearest`); record which tier served it."""
        assert self.manifest is not None

        def served(i: int, tier: Tier) -> None:
            with self._lock:
                if self._served.get(entry.path, -1) < i:
                    self._served[entry.path], self.sources[entry.path] = i, tier.role

        fallback.read_nearest(
            self.manifest, self._holders, entry, consume, node_local=self.node_local, served=served
        )
