"""Reading a raw-encoded data file (:mod:`tierstore.commit.encoding`) into DCP's targets.

One :class:`Unit` is a run of a file's items that one thread reads from one tier. For each
stored item, the bytes DCP wants go straight into the destination tensor (``readinto``) when
it is a contiguous CPU tensor of the stored dtype and the read is the whole item or a
dim-0 slice of it; otherwise into a reused buffer, then narrowed and copied. Every block the
bytes fall in is verified (:func:`encoding.verify_blocks`) before the planner is told the
tensor is loaded; a partial block at an edge of the read is read whole into a small buffer
to be verified. No ``torch.load``, no pickle.

When a load reads every item of a file whole, the units also read the padding between them
and fold the block checksums into the file's CRC32C, which the caller holds to the manifest:
such a load checks every byte of the file, as the dcp encoding's streaming read does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from tierstore.commit import encoding
from tierstore.commit.encoding import RawItem
from tierstore.commit.manifest import FileEntry
from tierstore.commit.safe_pickle import safe_byte_io
from tierstore.errors import ChecksumMismatch, IntegrityError
from tierstore.storage.checksum import COMBINE_MIN, crc32c_combine, crc32c_update

__all__ = ["Planner", "Unit", "Want", "misfolded", "plan", "positional", "read_unit", "split",
           "whole_file"]

_SCRATCH = 1 << 20  # padding and forward skips go through this much at a time
SPLIT_MIN = 64 << 20  # a thread's share of a file is at least this many bytes


@dataclass(frozen=True)
class Want:
    """One stored item of a file and every read DCP wants from it."""

    index: MetadataIndex
    item: RawItem
    reqs: tuple[ReadItem, ...]


@dataclass(frozen=True)
class Unit:
    """Items (by offset) of one file read by one thread; with ``span``, the bytes
    ``[start, stop)`` of the file it covers whole, padding included, for the file's CRC32C."""

    entry: FileEntry
    wants: tuple[Want, ...]
    span: tuple[int, int] | None


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

    def load_bytes(self, req: ReadItem, payload: bytes) -> None:
        with self._lock:
            self._planner.load_bytes(req, safe_byte_io(payload))


def positional(raw: BinaryIO) -> bool:
    """Whether reads of ``raw`` can start anywhere (a file descriptor, or a seekable stream)."""
    return _fd(raw) is not None or _seekable(raw)


def _fd(raw: BinaryIO) -> int | None:
    try:
        return raw.fileno() if hasattr(os, "preadv") else None
    except (AttributeError, OSError, ValueError):
        return None


def _seekable(raw: BinaryIO) -> bool:
    try:
        return bool(raw.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def plan(files: Mapping[str, Sequence[ReadItem]], storage: Mapping[MetadataIndex, Any],
         entry_of: Callable[[str], FileEntry], threads: int) -> list[Unit]:
    """The units that read ``files`` (path -> DCP's reads in it), at most ``threads`` a file."""
    counts: dict[str, int] = {}
    for info in storage.values():
        if isinstance(info, RawItem):
            counts[info.relative_path] = counts.get(info.relative_path, 0) + 1
    units: list[Unit] = []
    for path, items in files.items():
        reqs: dict[MetadataIndex, list[ReadItem]] = {}
        for item in items:
            reqs.setdefault(item.storage_index, []).append(item)
        wants = [Want(index, storage[index], tuple(r)) for index, r in reqs.items()]
        units += split(entry_of(path), wants, whole_file(wants, counts.get(path, 0)), threads)
    return units


def misfolded(done: Sequence[tuple[Unit, int | None]]) -> list[Unit]:
    """Files read whole in several units whose CRC32Cs do not fold into the manifest's
    (damage outside every block the units verified), each as one unit to read again."""
    parts: dict[str, list[tuple[Unit, int | None]]] = {}
    for unit, crc in done:
        parts.setdefault(unit.entry.path, []).append((unit, crc))
    again = []
    for pieces in parts.values():
        spans = [(u.span, u, c) for u, c in pieces if u.span is not None and c is not None]
        if len(pieces) < 2 or len(spans) != len(pieces):
            continue
        crc = 0
        for (start, stop), _, part in sorted(spans, key=lambda s: s[0]):
            crc = crc32c_combine(crc, part, stop - start)
        entry = pieces[0][0].entry
        if crc != entry.crc32c:
            again.append(Unit(entry, tuple(w for u, _ in pieces for w in u.wants), (0, entry.size)))
    return again


def split(entry: FileEntry, wants: Sequence[Want], whole: bool, threads: int) -> list[Unit]:
    """The file's wanted items in up to ``threads`` units of similar byte counts.

    ``whole``: the load wants every item of the file whole, so the units tile the file.
    """
    ordered = sorted(wants, key=lambda w: w.item.offset)
    total = sum(w.item.length for w in ordered)
    count = max(1, min(threads, total // SPLIT_MIN, len(ordered)))
    groups: list[list[Want]] = [[]]
    done = 0
    for want in ordered:
        if groups[-1] and done >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(want)
        done += want.item.length
    units, start = [], 0
    for i, group in enumerate(groups):
        last = group[-1].item
        stop = entry.size if i + 1 == len(groups) else last.offset + last.length
        units.append(Unit(entry, tuple(group), (start, stop) if whole else None))
        start = stop
    return units


class _Reader:
    """One unit's reads from one opened copy of the file."""

    def __init__(self, raw: BinaryIO, entry: FileEntry, *, checkpoint: str, tier: str) -> None:
        self._raw, self._fd, self._seekable = raw, _fd(raw), _seekable(raw)
        self._pos = 0  # where a forward-only stream is
        self.entry, self.checkpoint, self.tier = entry, checkpoint, tier
        self._scratch = memoryview(bytearray(0))
        self._buffer = memoryview(bytearray(0))

    def corrupt(self, message: str) -> IntegrityError:
        return IntegrityError(message, checkpoint=self.checkpoint, file=self.entry.path,
                              tier=self.tier)

    def scratch(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = memoryview(bytearray(n))
        return self._scratch[:n]

    def buffer(self, n: int) -> memoryview:
        if len(self._buffer) < n:
            self._buffer = memoryview(bytearray(n))
        return self._buffer[:n]

    def read_at(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset``."""
        done = 0
        if self._fd is None and not self._seekable:
            self._skip_to(offset)
        elif self._fd is None:
            self._raw.seek(offset)
        while done < len(out):
            part = out[done:]
            n = (os.preadv(self._fd, [part], offset + done) if self._fd is not None
                 else self._raw.readinto(part))  # type: ignore[attr-defined]
            if not n:
                raise ChecksumMismatch.size(self.entry.size, offset + done,
                                            checkpoint=self.checkpoint, file=self.entry.path,
                                            tier=self.tier)
            done += n
        self._pos = offset + done

    def _skip_to(self, offset: int) -> None:
        if offset < self._pos:  # units read in file order: only forged metadata goes back
            raise self.corrupt(f"DCP metadata has overlapping items: one starts at byte {offset}, "
                               f"inside the previous one (which ends at byte {self._pos})")
        while self._pos < offset:
            chunk = self.scratch(min(_SCRATCH, offset - self._pos))
            self.read_at(self._pos, chunk)  # forward-only: reads continue where it is

    def read_range(self, item: RawItem, start: int, stop: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, stop)`` of ``item``, verifying every block they
        touch; whole blocks go straight into ``out``, edge blocks through the scratch buffer."""
        if start == stop:
            return
        block = item.block
        first, end = start // block, -(-stop // block)
        inner_first = -(-start // block)
        inner_end = end if stop == item.length else stop // block
        head = first < inner_first  # reads in file order: a forward-only stream never goes back
        if head:
            self._edge(item, first, start, stop, out)
        if inner_first < inner_end:  # blocks entirely inside the read, in one read
            lo, hi = item.block_span(inner_first)[0], item.block_span(inner_end - 1)[1]
            direct = out[lo - start:hi - start]
            self.read_at(item.offset + lo, direct)
            encoding.verify_blocks(item, inner_first, direct, checkpoint=self.checkpoint,
                                   tier=self.tier)
        if inner_end < end and not (head and end - 1 == first):
            self._edge(item, end - 1, start, stop, out)

    def _edge(self, item: RawItem, index: int, start: int, stop: int, out: memoryview) -> None:
        """Read block ``index`` whole to verify it; copy its part in ``[start, stop)`` out."""
        lo, hi = item.block_span(index)
        whole = self.scratch(hi - lo)
        self.read_at(item.offset + lo, whole)
        encoding.verify_blocks(item, index, whole, checkpoint=self.checkpoint, tier=self.tier)
        a, b = max(lo, start), min(hi, stop)
        out[a - start:b - start] = whole[a - lo:b - lo]


def read_unit(raw: BinaryIO, unit: Unit, planner: Planner, *, checkpoint: str,
              tier: str) -> int | None:
    """Read and deliver every item of ``unit`` from ``raw``; the CRC32C of its span, if any."""
    reader = _Reader(raw, unit.entry, checkpoint=checkpoint, tier=tier)
    for want in unit.wants:
        problem = encoding.check_item(want.item, unit.entry.size)
        if problem is not None:
            raise reader.corrupt(f"DCP metadata of item {want.index.fqn!r} is inconsistent: {problem}")
    crc, pos = 0, None if unit.span is None else unit.span[0]
    for want in unit.wants:
        if pos is not None:
            crc, pos = _fold_gap(reader, crc, pos, want.item.offset)
        data = _deliver(reader, want, planner)
        if pos is not None and data is not None:
            crc, pos = _fold_item(want.item, data, crc), want.item.offset + want.item.length
    if pos is not None and unit.span is not None:
        crc, pos = _fold_gap(reader, crc, pos, unit.span[1])
    return None if unit.span is None else crc


def _fold_gap(reader: _Reader, crc: int, pos: int, stop: int) -> tuple[int, int]:
    if stop < pos:
        raise reader.corrupt(f"DCP metadata has overlapping items: one starts at byte {stop}, "
                             f"inside the previous one (which ends at byte {pos})")
    while pos < stop:
        chunk = reader.scratch(min(_SCRATCH, stop - pos))
        reader.read_at(pos, chunk)
        crc, pos = crc32c_update(crc, chunk), pos + len(chunk)
    return crc, pos


def _fold_item(item: RawItem, data: memoryview, crc: int) -> int:
    """Extend the span's CRC32C over a whole item just read (and verified) into ``data``."""
    for index, expected in enumerate(item.crc32c):
        lo, hi = item.block_span(index)
        # The stored checksum equals the block's (verified): combining it costs no scan.
        crc = (crc32c_combine(crc, expected, hi - lo) if hi - lo >= COMBINE_MIN
               else crc32c_update(crc, data[lo:hi]))
    return crc


def _deliver(reader: _Reader, want: Want, planner: Planner) -> memoryview | None:
    """Read what ``want`` needs and hand it to the planner; the whole item's bytes if read."""
    item = want.item
    dtype = encoding.dtype_of(item.dtype)
    if dtype is None:  # a BYTE_IO item (check_item refused unknown dtypes)
        data = reader.buffer(item.length)
        reader.read_range(item, 0, item.length, data)
        for req in want.reqs:
            if req.type != LoadItemType.BYTE_IO:
                raise reader.corrupt(f"item {want.index.fqn!r} is stored as bytes, read as a tensor")
            try:
                planner.load_bytes(req, bytes(data))
            except Exception as err:
                raise reader.corrupt(f"item {want.index.fqn!r} cannot be loaded safely: "
                                     f"{type(err).__name__}: {err}") from err
        return data
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
            return out if (start, stop) == (0, item.length) else None
    data = reader.buffer(stop - start)
    reader.read_range(item, start, stop, data)
    stored = _view(data, dtype, item.shape, end_row - first_row)
    for req in want.reqs:
        target = planner.resolve_tensor(req)
        chunk = stored
        for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            chunk = chunk.narrow(dim, offset - first_row if dim == 0 else offset, length)
        if target.size() != chunk.size():
            raise reader.corrupt(f"stored chunk of {req.storage_index.fqn!r} has shape "
                                 f"{tuple(chunk.size())}, expected {tuple(target.size())}")
        target.copy_(chunk)
        planner.commit_tensor(req, target)
    return data if (start, stop) == (0, item.length) else None


def _rows(reader: _Reader, want: Want, req: ReadItem) -> tuple[int, int]:
    """The dim-0 rows ``req`` reads (``(0, 1)`` for a 0-dim tensor), after checking that
    its region lies inside the stored tensor."""
    shape = want.item.shape
    if req.type == LoadItemType.BYTE_IO or len(req.storage_offsets) != len(shape) or len(
            req.lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, shape)):
        raise reader.corrupt(f"read of item {want.index.fqn!r} at {tuple(req.storage_offsets)} "
                             f"size {tuple(req.lengths)} is outside the stored tensor "
                             f"{want.item.dtype}{list(shape)}")
    if not shape:
        return 0, 1
    return req.storage_offsets[0], req.storage_offsets[0] + req.lengths[0]


def _direct(target: torch.Tensor, dtype: torch.dtype, req: ReadItem, item: RawItem) -> bool:
    """Whether the read can land in ``target``'s own memory: same dtype, CPU, contiguous,
    and a dim-0 slice of the stored tensor (every other dimension whole)."""
    whole_rows = all(o == 0 and n == d for o, n, d in
                     zip(req.storage_offsets[1:], req.lengths[1:], item.shape[1:]))
    return (target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous()
            and not target.is_conj() and not target.is_neg() and whole_rows
            and tuple(target.shape) == tuple(req.lengths))


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


def whole_file(wants: Sequence[Any], all_items: int) -> bool:
    """Whether ``wants`` read every one of a file's ``all_items`` items whole."""
    if len(wants) != all_items:
        return False
    for want in wants:
        item = want.item
        if item.dtype == encoding.BYTES:
            continue
        dtype = encoding.dtype_of(item.dtype)
        if dtype is None or not item.shape:
            continue
        # A read takes whole rows, from the first row any request wants to the last.
        spans = [(r.storage_offsets[0], r.storage_offsets[0] + r.lengths[0])
                 for r in want.reqs if len(r.storage_offsets) == len(item.shape)]
        if not spans or min(spans)[0] != 0 or max(b for _, b in spans) != item.shape[0]:
            return False
    return True
