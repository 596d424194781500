"""Deserialize what a store holds without ever running code from it.

Even after the manifest vouches for its bytes, ``.metadata`` is a pickle and a non-tensor
(``BYTE_IO``) item is a ``torch.save`` payload: a forged checkpoint could carry code in
either. ``load_metadata`` builds only the exact ``(module, name)`` pairs DCP metadata is made
of: no other callable, no dotted name (from protocol 4 ``find_class`` walks ``a.b.c``, so
allowing a module by name would hand out everything it imports), and no bytes after the
pickle's STOP; what it builds must then describe a checkpoint that loads whole and right
(``_check_shape``). That allow-list is ours alone: no user type belongs in ``.metadata``, so
torch's ``add_safe_globals`` does not extend it. ``safe_byte_io`` decodes a ``BYTE_IO``
payload with torch's ``weights_only`` unpickler, whose allow-list ``add_safe_globals``
extends, and re-encodes the result, so a planner that ``torch.load``\\ s it without
``weights_only`` (DCP's ``DefaultLoadPlanner`` does) only ever sees bytes we produced. A
type outside that list is refused as :class:`~tierstore.errors.UnsafeType` (policy), not as
damage: ``io.BytesIO`` included, as torch refuses it by default.
"""

from __future__ import annotations

import bisect
import importlib
import io
import itertools
import math
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

from tierstore.errors import UnsafeType
from tierstore.format import encoding
from tierstore.format.encoding import RawItem

__all__ = ["load_metadata", "safe_byte_io", "ALLOWED"]

_DCP = "torch.distributed.checkpoint.metadata"

#: Every global DCP metadata may name: its dataclasses and enum, the storage info our writer
#: (``RawItem``, or ``_StorageInfo`` in the dcp encoding) and FileSystemWriter record, and
#: plain constructors. Checked on real saves of every dtype,
#: FSDP2/DTensor state with optimizer, and BYTE_IO items (tests/format/test_safe_pickle.py).
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("tierstore.format.encoding", "RawItem"),
        ("torch.serialization", "_get_layout"),  # name -> torch.layout, a dict lookup
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PosixPath"),
    }
)

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
            f"{len(data) - stream.tell()} bytes follow the pickle's STOP (smuggled or appended)"
        )
    if not isinstance(value, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata is a {type(value).__name__}, not a Metadata object")
    _check_shape(value)
    return value


def _check_shape(metadata: Metadata) -> None:
    """Raise ``UnpicklingError`` unless every item the metadata lists can be located.

    Built from allowed types, fields can still hold anything (a ``str`` offset, a negative
    length, a chunk outside its tensor): the reader relies on these checks, and on
    ``_VerifiedStream`` for offsets against the real file size. They are also what makes a
    forged, re-sealed ``.metadata`` refused rather than loaded wrong (docs/design.md
    invariants 5 and 6): each tensor's chunks tile it exactly (else part of a destination
    would keep its old values), each ``RawItem`` is what its chunk says (dtype, shape,
    ``length``), and no two items of a file share a byte (else a partial load could return
    another item's bytes, checksums and all). All O(items), from ``.metadata`` alone.
    """
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise pickle.UnpicklingError("DCP metadata has no storage data or state dict metadata")
    for index, info in storage.items():
        dcp_info = (
            isinstance(info, _StorageInfo)
            and isinstance(info.relative_path, str)
            and _is_count(info.offset)
            and _is_count(info.length)
        )
        if not (isinstance(index, MetadataIndex) and (dcp_info or encoding.check_fields(info))):
            raise pickle.UnpicklingError(f"DCP metadata has a malformed storage entry {info!r}")
        problem = encoding.check_item(info) if isinstance(info, RawItem) else None
        if problem is not None:
            raise pickle.UnpicklingError(f"DCP metadata of item {index.fqn!r} is inconsistent: {problem}")
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            _need(storage, MetadataIndex(fqn), fqn)
            _check_raw(storage[MetadataIndex(fqn)], None, None, fqn)
        elif isinstance(item, TensorStorageMetadata) and isinstance(item.size, torch.Size):
            for chunk in item.chunks:
                _check_chunk(chunk, item.size, fqn)
                _need(storage, MetadataIndex(fqn, chunk.offsets), fqn)
            _check_tiling(item.chunks, item.size, fqn)
            dtype = getattr(item.properties, "dtype", None)
            for chunk in item.chunks:
                _check_raw(storage[MetadataIndex(fqn, chunk.offsets)], dtype, chunk.sizes, fqn)
        else:
            raise pickle.UnpicklingError(f"DCP metadata of {fqn!r} is a {type(item).__name__}")
    _check_disjoint(storage)


def _check_raw(info: Any, dtype: Any, sizes: torch.Size | None, fqn: str) -> None:
    """A ``RawItem`` holds what the state dict metadata says: bytes for a ``BYTE_IO`` item
    (``sizes`` None), else the chunk's shape in the tensor's dtype."""
    if not isinstance(info, RawItem):
        return
    if sizes is None:
        want = encoding.BYTES
    else:
        want = encoding.dtype_name(dtype) if isinstance(dtype, torch.dtype) else f"dtype {dtype!r}"
    shape = () if sizes is None else tuple(sizes)
    if info.dtype != want or info.shape != shape:
        what = "bytes" if sizes is None else "tensor"
        raise pickle.UnpicklingError(
            f"DCP metadata of item {fqn!r} is inconsistent: stored as {info.dtype}{list(info.shape)}, "
            f"its {what} metadata says {want}{list(shape)}"
        )


def _check_tiling(chunks: Any, size: torch.Size, fqn: str) -> None:
    """The chunks (each inside the tensor) cover every element once: DCP's own check of a
    save plan (``default_planner._validate_global_plan``), by volume and a sweep for overlaps."""
    boxes = [c for c in chunks if math.prod(c.sizes)]
    volume = sum(math.prod(c.sizes) for c in boxes)
    if volume != math.prod(size):
        raise pickle.UnpicklingError(
            f"DCP metadata's chunks of {fqn!r} cover {volume} of its {math.prod(size)} elements: "
            f"they do not cover the tensor of size {tuple(size)} exactly"
        )
    if len(boxes) < 2:
        return
    # Sweep the dimension with the most distinct offsets: shards along it meet few others.
    dim = max(range(len(size)), key=lambda d: len({c.offsets[d] for c in boxes}))
    active: list[tuple[int, int]] = []  # (end along dim, box), by end
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[dim]):
        box = boxes[i]
        del active[: bisect.bisect_right(active, (box.offsets[dim], len(boxes)))]
        for _, j in active:
            if _overlap(box, boxes[j]):
                raise pickle.UnpicklingError(
                    f"DCP metadata's chunks of {fqn!r} overlap: at {tuple(box.offsets)} and "
                    f"{tuple(boxes[j].offsets)}, so they do not cover the tensor exactly"
                )
        bisect.insort(active, (box.offsets[dim] + box.sizes[dim], i))


def _overlap(a: Any, b: Any) -> bool:
    return all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_disjoint(storage: dict[Any, Any]) -> None:
    """No two items of one file share a byte. The writer stores items in file order, so
    each file's list is sorted already and sorting it again is linear."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for path, spans in by_file.items():
        spans.sort()
        for (offset, length, fqn), (next_offset, _, next_fqn) in itertools.pairwise(spans):
            if next_offset < offset + length:
                raise pickle.UnpicklingError(
                    f"DCP metadata has overlapping items in {path!r}: {next_fqn!r} starts at byte "
                    f"{next_offset}, inside {fqn!r} (bytes {offset} to {offset + length})"
                )


def _check_chunk(chunk: Any, size: torch.Size, fqn: str) -> None:
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    if not (
        isinstance(chunk, ChunkStorageMetadata)
        and isinstance(offsets, torch.Size)
        and isinstance(sizes, torch.Size)
        and len(offsets) == len(sizes) == len(size)
        and all(o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(offsets, sizes, size))
    ):
        raise pickle.UnpicklingError(
            f"DCP metadata has a chunk of {fqn!r} outside its tensor of size {tuple(size)}: {chunk!r}"
        )


def _need(storage: dict[Any, Any], index: MetadataIndex, fqn: str) -> None:
    if index not in storage:
        raise pickle.UnpicklingError(f"DCP metadata does not say where item {fqn!r} is stored")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def safe_byte_io(payload: bytes, *, item: str | None = None, **where: Any) -> io.BytesIO:
    """A ``BYTE_IO`` payload re-encoded after a ``weights_only`` decode.

    What may be decoded is torch's allow-list, ``torch.serialization.add_safe_globals`` (and
    the ``safe_globals`` context) included, as for any ``torch.load``. A payload that names
    globals outside it raises :class:`~tierstore.errors.UnsafeType` naming them (``item``
    and ``where``, e.g. ``checkpoint=``, ``file=``, ``tier=``, go into it): a refusal by
    policy, not damage (docs/design.md invariant 6). Anything else that fails to decode raises
    as it is (``pickle.UnpicklingError`` or another ``Exception``): the caller's damage.
    """
    try:
        value = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:
        refused = _refused_globals(payload)
        if not refused:
            raise
        names, them = ", ".join(refused), "it" if len(refused) == 1 else "them"
        raise UnsafeType(
            f"item {item!r} holds {names}, outside torch's weights_only allow-list: refused, "
            "because unpickling it could run code from the store (the checkpoint is not "
            f"damaged). If you trust {them}, allow {them} before loading: "
            f"torch.serialization.add_safe_globals([{names}])",
            types=refused,
            item=item,
            **where,
        ) from err
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


# Names no state dict's torch.save writes, only a forged payload meant to run code, read
# files or start processes: naming one is damage, not a type to offer for allow-listing.
# This only picks the error; what is refused is torch's allow-list either way.
_CODE_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "_posixsubprocess",
        "sys",
        "importlib",
        "runpy",
        "shutil",
        "socket",
        "ctypes",
        "code",
        "codeop",
        "pty",
        "marshal",
        "pickle",
        "_pickle",
        "multiprocessing",
        "signal",
        "webbrowser",
        "pdb",
    }
)
_CODE_NAMES = frozenset(
    {
        f"builtins.{n}"
        for n in (
            "eval",
            "exec",
            "compile",
            "getattr",
            "setattr",
            "delattr",
            "__import__",
            "open",
            "input",
            "breakpoint",
            "globals",
            "locals",
            "vars",
            "__build_class__",
        )
    }
    | {f"{m}.{n}" for m in ("io", "_io") for n in ("open", "open_code", "FileIO")}
)


def _refused_globals(payload: bytes) -> tuple[str, ...]:
    """The globals (``module.qualname``) a payload names outside torch's allow-list, read
    from its pickle without running it; ``()`` when there are none, the payload is no
    ``torch.save`` archive, or one of them exists only to run code (see above)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload))
    except Exception:  # not an archive torch can take apart: damaged, reported as such
        return ()
    if any(g in _CODE_NAMES or g.split(".", 1)[0] in _CODE_MODULES for g in found):
        return ()
    return tuple(sorted(found))
