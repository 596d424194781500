"""Dcp-encoded data files (``encoding="dcp"``): what ``FileSystemWriter`` writes, one
``torch.save`` per item, and reading them back, each item at the offset DCP's metadata gives,
checked against the file (the metadata is input too), loaded without running stored code.

:func:`write_items` lays a shard file out as ``FileSystemWriter`` does, through DCP's stream
transforms when there are any; :func:`without_zip_crc32` turns off torch's own zip CRC32
while tierstore writes (tierstore's CRC32C covers the same bytes).

:class:`ItemStream` wraps the verified stream of one file (:mod:`tierstore.format.verified`);
:func:`deliver` hands one item to DCP's load planner: a tensor loaded ``weights_only`` and
narrowed to the requested chunk, or a ``BYTE_IO`` item re-encoded by the safe unpickler.
Used by :class:`tierstore.dcp.reader.TieredReader` for every file of a checkpoint saved with
``encoding="dcp"`` (raw-encoded files: :mod:`tierstore.dcp.raw_read`).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, Protocol, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import (
    _StorageInfo,
    _StorageReaderTransforms,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem, WriteItem, WriteItemType

from tierstore.errors import IntegrityError, UnsafeType
from tierstore.format import encoding as raw
from tierstore.format.safe_pickle import safe_byte_io
from tierstore.format.verified import VerifiedStream
from tierstore.storage.backend import ObjectWriter

__all__ = ["ItemStream", "deliver", "plain_cpu", "without_zip_crc32", "write_items"]


def write_items(
    out: ObjectWriter,
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    relpath: str,
    extensions: Sequence[StreamTransformExtension] = (),
) -> list[tuple[WriteItem, _StorageInfo | raw.RawItem]]:
    """Lay items out as ``FileSystemWriter`` does: one ``torch.save`` per tensor, through
    DCP's stream transforms (``_extensions``) when there are any. ``out`` checksums what
    reaches it, so the file's CRC32C is of the transformed bytes."""
    transforms = _StorageWriterTransforms(extensions) if extensions else None
    placed: list[tuple[WriteItem, _StorageInfo | raw.RawItem]] = []
    for item in items:
        offset = out.size
        data = resolve(item)
        sink, descriptors = (
            (cast(IO[bytes], out), [])
            if transforms is None
            else transforms.transform_save_stream(item, cast(io.IOBase, out))
        )
        try:
            if item.type == WriteItemType.BYTE_IO:
                sink.write(data.getbuffer() if isinstance(data, io.BytesIO) else data)
            else:
                torch.save(plain_cpu(data), sink)
            if transforms is not None:
                sink.close()  # flushes the transform's tail; DCP's wrapper leaves ``out`` open
        except Exception as err:
            if out.failure is not None and out.failure is not err:  # a full disk, not torch's
                raise out.failure from err  # "unexpected pos"
            raise
        placed.append(
            (
                item,
                _StorageInfo(relpath, offset, out.size - offset, transform_descriptors=descriptors or None),
            )
        )
    return placed


# torch.save computes a zip CRC32 of every record, in software: about 3x the CPU of the
# CRC32C tierstore computes over the same bytes as it writes them, which every read verifies
# (torch.load never checks the zip CRC32). So it is off while TieredWriters write: measured in
# benchmarks/jobs/cpu_costs.py, it is the largest CPU item of a save. The switch is process-wide
# (torch.serialization.set_crc32_options): the first writer in turns it off, the last one
# out restores it; a torch.save of another thread in that window skips it too, and its file
# loads as usual.
_zip_crc32_lock = threading.Lock()
_zip_crc32_writers = 0
_zip_crc32_saved = True


@contextmanager
def without_zip_crc32() -> Iterator[None]:
    global _zip_crc32_writers, _zip_crc32_saved
    with _zip_crc32_lock:
        if _zip_crc32_writers == 0:
            _zip_crc32_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _zip_crc32_writers += 1
    try:
        yield
    finally:
        with _zip_crc32_lock:
            _zip_crc32_writers -= 1
            if _zip_crc32_writers == 0:
                torch.serialization.set_crc32_options(_zip_crc32_saved)


def _reset_zip_crc32_after_fork() -> None:
    # A child forked mid-write has no writer running: give torch back its setting.
    global _zip_crc32_lock, _zip_crc32_writers
    if _zip_crc32_writers:
        torch.serialization.set_crc32_options(_zip_crc32_saved)
    _zip_crc32_lock, _zip_crc32_writers = threading.Lock(), 0


os.register_at_fork(after_in_child=_reset_zip_crc32_after_fork)


def plain_cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # a view: save only its own bytes, not the whole storage
    return tensor


def deliver(
    req: ReadItem,
    payload: bytes,
    planner: LoadPlanner,
    stream: ItemStream,
    transforms: _StorageReaderTransforms | None = None,
    descriptors: Sequence[str] | None = None,
) -> None:
    # Nothing stored reaches a code-running unpickler: tensors load weights_only, and a
    # BYTE_IO item reaches the planner (whose torch.load has weights_only=False) re-encoded.
    try:
        if descriptors and transforms is not None:  # undone as DCP's reader does
            payload = transforms.transform_load_stream(req, descriptors, io.BytesIO(payload)).read(-1)
        if req.type == LoadItemType.BYTE_IO:
            f = stream.verified
            planner.load_bytes(
                req,
                safe_byte_io(
                    payload,
                    item=req.storage_index.fqn,
                    checkpoint=f.checkpoint,
                    file=f.entry.path,
                    tier=f.tier,
                ),
            )
            return
        tensor = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"found a {type(tensor).__name__}, not a tensor")
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    except UnsafeType:
        raise  # a refusal by policy, not damage: raised after the file verified (deliver_all)
    except Exception as err:
        raise stream.corrupt(
            f"item {req.storage_index.fqn!r} cannot be loaded safely: {type(err).__name__}: {err}"
        ) from err
    commit_chunk(planner, req, planner.resolve_tensor(req).detach(), tensor, stream.corrupt)


class CommitsTensors(Protocol):
    """What :func:`commit_chunk` needs of a planner (DCP's, or the raw reader's locked one)."""

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None: ...


def commit_chunk(
    planner: CommitsTensors,
    req: ReadItem,
    target: torch.Tensor,
    chunk: torch.Tensor,
    corrupt: Callable[[str], Exception],
) -> None:
    """Copy a stored ``chunk`` into the ``target`` the planner resolved for ``req`` and commit
    it; a chunk of another shape is damage the checksums could not see (``corrupt`` words
    the error, naming the file)."""
    if target.size() != chunk.size():
        raise corrupt(
            f"stored chunk of {req.storage_index.fqn!r} has shape "
            f"{tuple(chunk.size())}, expected {tuple(target.size())}"
        )
    target.copy_(chunk)
    planner.commit_tensor(req, target)


class ItemStream:
    """A verified file read item by item, at the offsets DCP metadata gives (checked: it is input too)."""

    def __init__(self, verified: VerifiedStream) -> None:
        self._file = verified

    @property
    def verified(self) -> VerifiedStream:
        return self._file

    def corrupt(self, message: str) -> IntegrityError:
        """An error about this file's contents or the metadata describing them."""
        f = self._file
        return IntegrityError(message, checkpoint=f.checkpoint, file=f.entry.path, tier=f.tier)

    def _check_span(self, what: str, value: Any, end: int) -> None:
        # DCP metadata is input: a negative, non-integer or too large span must not reach
        # read() (read(-1) reads everything) nor be reported as a size mismatch.
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.corrupt(f"DCP metadata gives item {what} {value!r}: not a byte count")
        if end > self._file.entry.size:
            raise self.corrupt(
                f"DCP metadata points past the end of the file: item {what} "
                f"{value} ends at byte {end}, the file has {self._file.entry.size}"
            )

    def read_exactly(self, n: int) -> bytes:
        self._check_span("length", n, self._file.pos + n if isinstance(n, int) else 0)
        return self._file.read_exactly(n)

    def skip_to(self, offset: int) -> None:
        self._check_span("offset", offset, offset if isinstance(offset, int) else 0)
        if offset < self._file.pos:
            raise self.corrupt(
                f"DCP metadata has overlapping items: one starts at byte {offset}, "
                f"inside the previous one (which ends at byte {self._file.pos})"
            )
        self._file.skip_to(offset)

    def finish(self) -> None:
        self._file.finish()
