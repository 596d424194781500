"""Hostile DCP metadata (built from allowed types, re-sealed in the manifest) gives a clean
IntegrityError naming file, checkpoint and tier: never a raw ValueError/KeyError/TypeError,
a read of the whole file, nor "expected 8255 bytes, found 8255 bytes"."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import unwrap

from tierstore import IntegrityError, TieredReader, TieredWriter
from tierstore.format import layout
from tierstore.format.manifest import _checksum
from tierstore.storage.backend import crc32c_update

NAME = layout.default_name(1)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(16, 8, generator=g),
        "b": torch.randn(40, generator=g),
        "c": torch.arange(12).reshape(3, 4),
        "extra": {"step": 1},
    }


def _blank() -> dict[str, Any]:
    return {
        "a": torch.zeros(16, 8),
        "b": torch.zeros(40),
        "c": torch.zeros(3, 4, dtype=torch.long),
        "extra": {"step": 0},
    }


def _tensor_items(meta: Any) -> list[Any]:
    """Storage indices of the tensors, in file order."""
    found = [i for i in meta.storage_data if i.fqn in ("a", "b", "c")]
    return sorted(found, key=lambda i: meta.storage_data[i].offset)


def _set(meta: Any, index: Any, **fields: Any) -> None:
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], **fields)


def _first(**fields: Any) -> Callable[[Any], None]:
    return lambda meta: _set(meta, _tensor_items(meta)[0], **fields)


def _overlap(meta: Any) -> None:
    first, second = _tensor_items(meta)[:2]
    _set(meta, second, offset=meta.storage_data[first].offset + 1)


def _shorter(meta: Any) -> None:
    index = _tensor_items(meta)[0]
    _set(meta, index, length=meta.storage_data[index].length - 100)


def _longer(meta: Any) -> None:  # swallows the next item's bytes
    first, second = _tensor_items(meta)[:2]
    info = meta.storage_data[second]
    _set(meta, first, length=info.offset + info.length - meta.storage_data[first].offset)


def _drop_entry(meta: Any) -> None:
    del meta.storage_data[_tensor_items(meta)[0]]


def _chunk_outside(meta: Any) -> None:
    chunk = meta.state_dict_metadata["a"].chunks[0]
    meta.state_dict_metadata["a"].chunks[0] = dataclasses.replace(chunk, sizes=torch.Size([99, 8]))


def _path_type(meta: Any) -> None:
    _set(meta, _tensor_items(meta)[0], relative_path=None)


def _end(meta: Any) -> int:
    return max(i.offset + i.length for i in meta.storage_data.values())


CASES: dict[str, Callable[[Any], None]] = {
    "negative length": _first(length=-5),
    "negative offset": _first(offset=-1),
    "offset past end": _first(offset=1 << 40),
    "length past end": _first(length=1 << 40),
    "string offset": _first(offset="12"),
    "float length": _first(length=12.0),
    "bool offset": _first(offset=True),
    "overlapping items": _overlap,
    "length shorter than the item": _shorter,
    "length longer than the item": _longer,
    "no storage entry for an item": _drop_entry,
    "chunk outside its tensor": _chunk_outside,
    "relative path not a string": _path_type,
}


def _forge(root: Path, mutate: Callable[[Any], None]) -> None:
    mpath = root / layout.manifest_key(NAME)
    body = json.loads(mpath.read_text())
    meta_path = root / layout.file_key(NAME, body["attempt"], ".metadata")
    meta = pickle.loads(meta_path.read_bytes())  # our own genuine save
    mutate(meta)
    data = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    meta_path.write_bytes(data)
    for entry in body["files"]:  # a forger who also fixes up sizes and checksums
        if entry["path"] == ".metadata":
            entry.update(size=len(data), crc32c=crc32c_update(0, data))
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    mpath.write_text(json.dumps(body))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("role", ["hot", "cold"])
def test_hostile_metadata_is_a_clean_integrity_error(tmp_path: Path, case: str, role: str) -> None:
    root = tmp_path / role
    dcp.save(_state(), storage_writer=TieredWriter(str(root), step=1))
    _forge(root, CASES[case])
    reader = TieredReader(str(root)) if role == "hot" else TieredReader(None, str(root))
    with pytest.raises(BaseException) as info:
        dcp.load(_blank(), storage_reader=reader)
    err = unwrap(info.value)
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == NAME and err.file in (".metadata", "__0_0.distcp"), err
    assert err.tier == f"{role} {root}", err
    same = re.search(r"expected (\d+) bytes, found (\d+) bytes", str(err))
    assert not (same and same[1] == same[2]), err


def test_untouched_metadata_still_loads(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=TieredWriter(str(tmp_path), step=1))
    _forge(tmp_path, lambda meta: None)  # re-pickled by the standard pickler: still fine
    target = _blank()
    dcp.load(target, storage_reader=TieredReader(str(tmp_path)))
    assert all(torch.equal(target[k], _state()[k]) for k in "abc") and target["extra"]["step"] == 1
