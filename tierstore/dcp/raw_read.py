"""Reading a raw-encoded data file (:mod:`tierstore.format.encoding`) into DCP's targets.

One :class:`Unit` is a run of a file's items that one thread reads from one tier. It reads
only the byte ranges its items' reads need, widened to whole blocks (each block is verified
against its CRC32C in the :class:`RawItem`, :func:`encoding.verify_blocks`, before the planner
is told the tensor is loaded), each range through one ``Backend.open_range`` request; ranges
of a file closer than :data:`COALESCE` bytes share a request and the gap is read and dropped.
A load never reads a whole file to check the manifest's CRC32C: bytes outside every wanted
block are not read, so damage there is found by ``tierstore verify`` (scrub), not by a load.
The zero padding between two items a load reads whole is read and checked, so a load of
every item of a file still checks every byte of it.

For each stored item, the bytes DCP wants go straight into the destination tensor
(``readinto``) when it is a contiguous CPU tensor of the stored dtype and the read is the
whole item or a dim-0 slice of it; otherwise into a reused buffer, then narrowed and copied;
a partial block at an edge of the read is read whole into a small buffer to be verified. No
``torch.load``, no pickle.

Why one module of about 400 lines: planning units, reading and verifying their ranges, and
placing the bytes into the targets are one path that each load follows end to end; the
shape check it shares with the DCP encoding's path is :func:`tierstore.dcp.dcp_files.commit_chunk`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from tierstore.dcp.dcp_files import commit_chunk
from tierstore.errors import ChecksumMismatch, IntegrityError, UnsafeType
from tierstore.format import encoding
from tierstore.format.encoding import RawItem
from tierstore.format.manifest import FileEntry
from tierstore.format.safe_pickle import safe_byte_io
from tierstore.storage.checksum import crc32c_update

__all__ = ["COALESCE", "Opener", "Planner", "Unit", "Want", "plan", "read_unit", "split"]

COALESCE = 64 << 10  # ranges of a file closer than this share one request
_SCRATCH = 1 << 20  # dropped gaps go through this much at a time
SPLIT_MIN = 64 << 20  # a thread's share of a file is at least this many bytes

#: Opens ``length`` bytes of the unit's file from ``offset`` (one request on an object store).
Opener = Callable[[int, int], BinaryIO]


@dataclass(frozen=True)
class Want:
    """One stored item of a file and every read DCP wants from it; ``pad``: the bytes of
    zero padding after it that the load checks (it reads the item and the next one whole)."""

    index: MetadataIndex
    item: RawItem
    reqs: tuple[ReadItem, ...]
    pad: int = 0


@dataclass(frozen=True)
class Unit:
    """Items (by offset) of one file read by one thread."""

    entry: FileEntry
    wants: tuple[Want, ...]


class Planner:
    """The load planner, one call at a time: the reader's threads share it."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner
        self._lock = threading.Lock()

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        with self._lock:
            return self._planner.resolve_tensor(req).detach()

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        with self._lock:
            self._planner.commit_tensor(req, tensor)

    def load_bytes(self, req: ReadItem, payload: bytes, **where: Any) -> None:
        """``where`` (checkpoint, file, tier) names the item's place in an ``UnsafeType``."""
        with self._lock:
            self._planner.load_bytes(req, safe_byte_io(payload, item=req.storage_index.fqn, **where))


def plan(
    files: Mapping[str, Sequence[ReadItem]],
    storage: Mapping[MetadataIndex, Any],
    entry_of: Callable[[str], FileEntry],
    threads: int,
) -> list[Unit]:
    """The units that read ``files`` (path -> DCP's reads in it), at most ``threads`` a file."""
    units: list[Unit] = []
    for path, items in files.items():
        reqs: dict[MetadataIndex, list[ReadItem]] = {}
        for item in items:
            reqs.setdefault(item.storage_index, []).append(item)
        wants = sorted(
            (Want(index, storage[index], tuple(r)) for index, r in reqs.items()), key=lambda w: w.item.offset
        )
        units += split(entry_of(path), _with_padding(wants), threads)
    return units


def _with_padding(ordered: Sequence[Want]) -> list[Want]:
    """``ordered`` with the padding between two neighbours read whole marked to be checked.

    A gap shorter than ``encoding.ALIGN`` between items is padding only (any item in it
    would start at an aligned offset and push the next one an ``ALIGN`` further).
    """
    marked = list(ordered)
    for i in range(len(marked) - 1):
        a, b = marked[i], marked[i + 1]
        gap = b.item.offset - (a.item.offset + a.item.length)
        if 0 < gap < encoding.ALIGN and _needed(a) == (0, a.item.length) and _needed(b) == (0, b.item.length):
            marked[i] = Want(a.index, a.item, a.reqs, gap)
    return marked


def split(entry: FileEntry, wants: Sequence[Want], threads: int) -> list[Unit]:
    """The file's wanted items (in file order) in up to ``threads`` units of similar byte counts."""
    total = sum(w.item.length for w in wants)
    count = max(1, min(threads, total // SPLIT_MIN, len(wants)))
    groups: list[list[Want]] = [[]]
    done = 0
    for want in wants:
        if groups[-1] and done >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(want)
        done += want.item.length
    return [Unit(entry, tuple(group)) for group in groups]


def _needed(want: Want) -> tuple[int, int] | None:
    """Bytes ``[start, stop)`` of the item that ``want``'s reads take (whole rows; a bytes
    item or a 0-dim tensor whole); ``None`` when a read does not fit the stored shape (the
    delivery reports it)."""
    item = want.item
    if encoding.dtype_of(item.dtype) is None or not item.shape:
        return 0, item.length
    if item.shape[0] == 0 or not all(_fits(r, item.shape) for r in want.reqs):
        return None
    spans = [(r.storage_offsets[0], r.storage_offsets[0] + r.lengths[0]) for r in want.reqs]
    row = item.length // item.shape[0]
    return min(a for a, _ in spans) * row, max(b for _, b in spans) * row


def _ranges(unit: Unit) -> list[tuple[int, int]]:
    """The file's byte ranges ``unit`` reads (wanted blocks, checked padding), coalesced."""
    spans = []
    for want in unit.wants:
        needed = _needed(want)
        item = want.item
        if needed is not None and needed[0] < needed[1]:
            first, end = needed[0] // item.block, -(-needed[1] // item.block)
            spans.append((item.offset + first * item.block, item.offset + min(end * item.block, item.length)))
        if want.pad:
            end = item.offset + item.length
            spans.append((end, end + want.pad))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start - merged[-1][1] < COALESCE:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


class _Reader:
    """One unit's reads of one copy of the file, in file order, one request per range."""

    def __init__(
        self,
        opener: Opener,
        ranges: Sequence[tuple[int, int]],
        entry: FileEntry,
        stack: ExitStack,
        count: Callable[[int], None],
        *,
        checkpoint: str,
        tier: str,
    ) -> None:
        self._opener, self._ranges, self._stack, self._count = opener, ranges, stack, count
        self._stream: BinaryIO | None = None
        self._pos = self._stop = 0  # where the open range stands, and where it ends
        self.entry, self.checkpoint, self.tier = entry, checkpoint, tier
        self._scratch = memoryview(bytearray(0))
        self._buffer = memoryview(bytearray(0))

    def corrupt(self, message: str) -> IntegrityError:
        return IntegrityError(message, checkpoint=self.checkpoint, file=self.entry.path, tier=self.tier)

    def scratch(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = memoryview(bytearray(n))
        return self._scratch[:n]

    def buffer(self, n: int) -> memoryview:
        if len(self._buffer) < n:
            self._buffer = memoryview(bytearray(n))
        return self._buffer[:n]

    def read_at(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset`` (never behind the last read)."""
        if offset < self._pos:  # reads go in file order: only forged metadata goes back
            raise self.corrupt(
                f"DCP metadata has overlapping items: one starts at byte {offset}, "
                f"inside the previous one (which ends at byte {self._pos})"
            )
        if self._stream is None or offset + len(out) > self._stop:
            self._open(offset, offset + len(out))
        while self._pos < offset:  # a gap of a coalesced range
            self._fill(self.scratch(min(_SCRATCH, offset - self._pos)))
        self._fill(out)

    def _open(self, start: int, stop: int) -> None:
        lo, hi = next(((a, b) for a, b in self._ranges if a <= start and stop <= b), (start, stop))
        if self._stream is not None:
            self._stream.close()
        self._stream = self._stack.enter_context(self._opener(lo, hi - lo))
        self._pos, self._stop = lo, hi

    def _fill(self, out: memoryview) -> None:
        assert self._stream is not None
        done = 0
        while done < len(out):
            n = self._stream.readinto(out[done:]) or 0  # type: ignore[attr-defined]
            if not n:
                raise ChecksumMismatch.size(
                    self.entry.size,
                    self._pos + done,
                    checkpoint=self.checkpoint,
                    file=self.entry.path,
                    tier=self.tier,
                )
            done += n
            self._count(n)
        self._pos += done

    def read_range(self, item: RawItem, start: int, stop: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, stop)`` of ``item``, verifying every block they
        touch; whole blocks go straight into ``out``, edge blocks through the scratch buffer."""
        if start == stop:
            return
        block = item.block
        first, end = start // block, -(-stop // block)
        inner_first = -(-start // block)
        inner_end = end if stop == item.length else stop // block
        head = first < inner_first  # in file order: a range stream never goes back
        if head:
            self._edge(item, first, start, stop, out)
        if inner_first < inner_end:  # blocks entirely inside the read, in one read
            lo, hi = item.block_span(inner_first)[0], item.block_span(inner_end - 1)[1]
            direct = out[lo - start : hi - start]
            self.read_at(item.offset + lo, direct)
            encoding.verify_blocks(item, inner_first, direct, checkpoint=self.checkpoint, tier=self.tier)
        if inner_end < end and not (head and end - 1 == first):
            self._edge(item, end - 1, start, stop, out)

    def _edge(self, item: RawItem, index: int, start: int, stop: int, out: memoryview) -> None:
        """Read block ``index`` whole to verify it; copy its part in ``[start, stop)`` out."""
        lo, hi = item.block_span(index)
        whole = self.scratch(hi - lo)
        self.read_at(item.offset + lo, whole)
        encoding.verify_blocks(item, index, whole, checkpoint=self.checkpoint, tier=self.tier)
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = whole[a - lo : b - lo]

    def check_padding(self, offset: int, length: int) -> None:
        """Read the padding at ``offset``; the encoding fills it with zeros."""
        data = self.scratch(length)
        self.read_at(offset, data)
        if any(data):
            raise ChecksumMismatch.crc32c(
                crc32c_update(0, bytes(length)),
                crc32c_update(0, data),
                checkpoint=self.checkpoint,
                file=self.entry.path,
                tier=self.tier,
            )


def read_unit(
    opener: Opener, unit: Unit, planner: Planner, *, checkpoint: str, tier: str, count: Callable[[int], None]
) -> None:
    """Read and deliver every item of ``unit`` through ``opener``; ``count`` is told each
    number of bytes read."""
    for want in unit.wants:
        problem = encoding.check_item(want.item, unit.entry.size)
        if problem is not None:
            raise IntegrityError(
                f"DCP metadata of item {want.index.fqn!r} is inconsistent: {problem}",
                checkpoint=checkpoint,
                file=unit.entry.path,
                tier=tier,
            )
    with ExitStack() as stack:
        reader = _Reader(opener, _ranges(unit), unit.entry, stack, count, checkpoint=checkpoint, tier=tier)
        for want in unit.wants:
            _deliver(reader, want, planner)
            if want.pad:
                reader.check_padding(want.item.offset + want.item.length, want.pad)


def _deliver(reader: _Reader, want: Want, planner: Planner) -> None:
    """Read what ``want`` needs and hand it to the planner."""
    item = want.item
    dtype = encoding.dtype_of(item.dtype)
    if dtype is None:  # a BYTE_IO item (check_item refused unknown dtypes)
        data = reader.buffer(item.length)
        reader.read_range(item, 0, item.length, data)
        for req in want.reqs:
            if req.type != LoadItemType.BYTE_IO:
                raise reader.corrupt(f"item {want.index.fqn!r} is stored as bytes, read as a tensor")
            try:
                planner.load_bytes(
                    req, bytes(data), checkpoint=reader.checkpoint, file=reader.entry.path, tier=reader.tier
                )
            except UnsafeType:
                raise  # a refusal by policy of verified bytes, not damage (safe_pickle)
            except Exception as err:
                raise reader.corrupt(
                    f"item {want.index.fqn!r} cannot be loaded safely: {type(err).__name__}: {err}"
                ) from err
        return
    row = _row_bytes(dtype, item.shape)
    rows = [_rows(reader, want, req) for req in want.reqs]
    first_row, end_row = min(r[0] for r in rows), max(r[1] for r in rows)
    start, stop = first_row * row, end_row * row
    if len(want.reqs) == 1:
        target = planner.resolve_tensor(want.reqs[0])
        if _direct(target, dtype, want.reqs[0], item):
            out = encoding.tensor_bytes(target) if target.numel() else memoryview(b"")
            reader.read_range(item, start, stop, out)
            planner.commit_tensor(want.reqs[0], target)
            return
    data = reader.buffer(stop - start)
    reader.read_range(item, start, stop, data)
    stored = _view(data, dtype, item.shape, end_row - first_row)
    for req in want.reqs:
        target = planner.resolve_tensor(req)
        chunk = stored
        for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            chunk = chunk.narrow(dim, offset - first_row if dim == 0 else offset, length)
        commit_chunk(planner, req, target, chunk, reader.corrupt)


def _rows(reader: _Reader, want: Want, req: ReadItem) -> tuple[int, int]:
    """The dim-0 rows ``req`` reads (``(0, 1)`` for a 0-dim tensor), after checking that
    its region lies inside the stored tensor."""
    shape = want.item.shape
    if not _fits(req, shape):
        raise reader.corrupt(
            f"read of item {want.index.fqn!r} at {tuple(req.storage_offsets)} "
            f"size {tuple(req.lengths)} is outside the stored tensor "
            f"{want.item.dtype}{list(shape)}"
        )
    if not shape:
        return 0, 1
    return req.storage_offsets[0], req.storage_offsets[0] + req.lengths[0]


def _fits(req: ReadItem, shape: tuple[int, ...]) -> bool:
    """Whether ``req`` reads a region inside a stored tensor of ``shape``."""
    return (
        req.type != LoadItemType.BYTE_IO
        and len(req.storage_offsets) == len(shape)
        and len(req.lengths) == len(shape)
        and all(o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(req.storage_offsets, req.lengths, shape))
    )


def _direct(target: torch.Tensor, dtype: torch.dtype, req: ReadItem, item: RawItem) -> bool:
    """Whether the read can land in ``target``'s own memory: same dtype, CPU, contiguous,
    and a dim-0 slice of the stored tensor (every other dimension whole)."""
    whole_rows = all(
        o == 0 and n == d for o, n, d in zip(req.storage_offsets[1:], req.lengths[1:], item.shape[1:])
    )
    return (
        target.dtype == dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and whole_rows
        and tuple(target.shape) == tuple(req.lengths)
    )


def _view(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...], rows: int) -> torch.Tensor:
    """``rows`` rows of the stored tensor over ``data`` (a 0-dim tensor: itself), no copy."""
    full = (rows, *shape[1:]) if shape else ()
    if not len(data):
        return torch.empty(full, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(full)


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    row = dtype.itemsize
    for n in shape[1:]:
        row *= n
    return row
