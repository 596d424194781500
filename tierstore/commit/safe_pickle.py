"""Deserialize what a store holds without ever running code from it.

Even after the manifest vouches for its bytes, ``.metadata`` is a pickle and a non-tensor
(``BYTE_IO``) item is a ``torch.save`` payload: a forged checkpoint could carry code in
either. ``load_metadata`` builds only the exact ``(module, name)`` pairs DCP metadata is made
of: no other callable, no dotted name (from protocol 4 ``find_class`` walks ``a.b.c``, so
allowing a module by name would hand out everything it imports), and no bytes after the
pickle's STOP. ``safe_byte_io`` decodes a ``BYTE_IO`` payload with torch's ``weights_only``
unpickler and re-encodes the result, so a planner that ``torch.load``\\ s it without
``weights_only`` (DCP's ``DefaultLoadPlanner`` does) only ever sees bytes we produced.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from tierstore.commit import encoding

__all__ = ["load_metadata", "safe_byte_io", "ALLOWED"]

_DCP = "torch.distributed.checkpoint.metadata"

#: Every global DCP metadata may name: its dataclasses and enum, the storage info our writer
#: (``RawItem``, or ``_StorageInfo`` in the dcp encoding) and FileSystemWriter record, and
#: plain constructors. Checked on real saves of every dtype,
#: FSDP2/DTensor state with optimizer, and BYTE_IO items (tests/test_safe_pickle.py).
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP, "Metadata"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("tierstore.commit.encoding", "RawItem"),
    ("torch.serialization", "_get_layout"),  # name -> torch.layout, a dict lookup
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PosixPath"),
})

# torch.float32 and friends: constants, never called.
_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in ALLOWED:
                return getattr(importlib.import_module(module), name)
            if module == "torch" and isinstance(vars(torch).get(name), _TORCH_CONSTANTS):
                return vars(torch)[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata(data: bytes) -> Metadata:
    """Unpickle and shape-check DCP ``.metadata``; raises ``pickle.UnpicklingError`` else.

    Other errors a hostile pickle provokes (``EOFError``, ``TypeError`` from a constructor
    given bad arguments, ...) become ``UnpicklingError`` too, so callers need catch one.
    """
    try:
        return _load(data)
    except pickle.UnpicklingError:
        raise
    except Exception as err:  # hostile fields may break any constructor or check
        raise pickle.UnpicklingError(f"malformed pickle: {type(err).__name__}: {err}") from err


def _load(data: bytes) -> Metadata:
    stream = io.BytesIO(data)
    value = _MetadataUnpickler(stream).load()
    if stream.tell() != len(data):
        raise pickle.UnpicklingError(
            f"{len(data) - stream.tell()} bytes follow the pickle's STOP (smuggled or appended)")
    if not isinstance(value, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata is a {type(value).__name__}, not a Metadata object")
    _check_shape(value)
    return value


def _check_shape(metadata: Metadata) -> None:
    """Raise ``UnpicklingError`` unless every item the metadata lists can be located.

    Built from allowed types, fields can still hold anything (a ``str`` offset, a negative
    length, a chunk outside its tensor): the reader relies on these checks, and on
    ``_VerifiedStream`` for offsets against the real file size.
    """
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise pickle.UnpicklingError("DCP metadata has no storage data or state dict metadata")
    for index, info in storage.items():
        dcp_info = (isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                    and _is_count(info.offset) and _is_count(info.length))
        if not (isinstance(index, MetadataIndex) and (dcp_info or encoding.check_fields(info))):
            raise pickle.UnpicklingError(f"DCP metadata has a malformed storage entry {info!r}")
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            _need(storage, MetadataIndex(fqn), fqn)
        elif isinstance(item, TensorStorageMetadata) and isinstance(item.size, torch.Size):
            for chunk in item.chunks:
                _check_chunk(chunk, item.size, fqn)
                _need(storage, MetadataIndex(fqn, chunk.offsets), fqn)
        else:
            raise pickle.UnpicklingError(f"DCP metadata of {fqn!r} is a {type(item).__name__}")


def _check_chunk(chunk: Any, size: torch.Size, fqn: str) -> None:
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    if not (isinstance(chunk, ChunkStorageMetadata) and isinstance(offsets, torch.Size)
            and isinstance(sizes, torch.Size) and len(offsets) == len(sizes) == len(size)
            and all(o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(offsets, sizes, size))):
        raise pickle.UnpicklingError(f"DCP metadata has a chunk of {fqn!r} outside its tensor "
                                     f"of size {tuple(size)}: {chunk!r}")


def _need(storage: dict[Any, Any], index: MetadataIndex, fqn: str) -> None:
    if index not in storage:
        raise pickle.UnpicklingError(f"DCP metadata does not say where item {fqn!r} is stored")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def safe_byte_io(payload: bytes) -> io.BytesIO:
    """A ``BYTE_IO`` payload re-encoded after a ``weights_only`` decode.

    Raises ``pickle.UnpicklingError`` (or another ``Exception``) for a payload that needs
    anything outside torch's ``weights_only`` allow-list; a user extends that list with
    ``torch.serialization.add_safe_globals`` like for any ``torch.load``.
    """
    value = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out
