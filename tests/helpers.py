"""Helpers shared by the core tests: a training state that is a function of its step, saving
and loading it through the tiers, finding a committed checkpoint's files, and damaging them.

The crash suite keeps its own model (tests/crash/model.py): its states and loads are shaped
for forked actors and invariant checks, not for single tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import ReaderOptions, Store, TieredReader, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.tiers.tier import Tier

SHAPE = (64, 33)  # odd width: shards never fall on a round size
DATA_FILE = layout.data_file_name(0, 0)


def unwrap(exc: BaseException) -> BaseException:
    """The first rank's original error inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc


def state_for(step: int, shape: tuple[int, ...] = SHAPE) -> dict[str, Any]:
    """What a run saves at ``step``: a float, a bfloat16 and an integer tensor, and extras."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(*shape, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "i": torch.arange(10) * step,
        "extra": {"step": step, "note": f"at {step}"},
    }


def blank(shape: tuple[int, ...] = SHAPE) -> dict[str, Any]:
    """A load target of :func:`state_for`'s structure holding none of its values."""
    return {
        "w": torch.zeros(*shape),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "i": torch.zeros(10, dtype=torch.long),
        "extra": {"step": -1, "note": ""},
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two states are equal bit for bit, dtypes included."""
    assert a["extra"] == b["extra"]
    for key in ("w", "b", "i"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def matches(state: dict[str, Any], step: int, shape: tuple[int, ...] = SHAPE) -> bool:
    """Does ``state`` hold exactly what was saved at ``step``?"""
    want = state_for(step, shape)
    return state["extra"] == want["extra"] and all(
        state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]) for k in ("w", "b", "i")
    )


def store_of(hot: str | None, cold: str | None, options: dict[str, Any]) -> Store:
    """The store of ``hot`` and ``cold``, with the tier options and ``node_local`` that
    ``options`` holds taken out of it (they live on the store)."""
    tier = {k: options.pop(k) for k in ("hot_options", "cold_options", "node_local") if k in options}
    return Store.of(hot, cold, **tier)


def save(
    hot: str,
    step: int,
    cold: str | None = None,
    *,
    shape: tuple[int, ...] = SHAPE,
    migrated: bool = False,
    **writer_options: Any,
) -> TieredWriter:
    """Save :func:`state_for` ``step``; ``migrated``: also wait until the cold copy commits.
    ``hot_options``, ``cold_options`` and ``node_local`` go to the store (:func:`store_of`)."""
    writer = TieredWriter(store_of(hot, cold, writer_options), step=step, **writer_options)
    dcp.save(state_for(step, shape), storage_writer=writer)
    if migrated:
        assert writer.migrator is not None and writer.migrator.wait(30)
    return writer


def load(
    hot: str | None, cold: str | None = None, *, shape: tuple[int, ...] = SHAPE, **reader_options: Any
) -> tuple[dict[str, Any], TieredReader]:
    """Load into :func:`blank`; returns the loaded state and the reader (which names the tier)."""
    target, reader = blank(shape), TieredReader(store_of(hot, cold, reader_options), **reader_options)
    dcp.load(target, storage_reader=reader)
    return target, reader


def load_error(hot: str | None, cold: str | None = None, **reader_options: Any) -> BaseException:
    """The error a load raises (it must raise), unwrapped from DCP's CheckpointException."""
    with pytest.raises(BaseException) as info:
        load(hot, cold, **reader_options)
    return unwrap(info.value)


def committed(root: str, step: int, role: str = "hot") -> Manifest:
    """The manifest of the committed checkpoint of ``step`` in the tier at ``root``."""
    manifest = Tier(role, root).find_manifest(layout.default_name(step))
    assert manifest is not None, f"step {step} is not committed in {root}"
    return manifest


def file_path(root: str, manifest: Manifest, file: str = DATA_FILE) -> Path:
    """Where a local tier keeps one file of a committed checkpoint."""
    return Path(root, layout.file_key(manifest.name, manifest.attempt, file))


def flip(path: Path, offset: int | None = None) -> None:
    """Flip one bit of the byte at ``offset`` (default: the middle one; negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def saved(hot: str, step: int, cold: str | None = None, **options: Any) -> Manifest:
    """:func:`save`, returning the manifest the save committed in the hot tier."""
    manifest = save(hot, step, cold, **options).manifest
    assert manifest is not None
    return manifest


def assert_every_listed_checkpoint_loads(hot: str | None, cold: str | None = None) -> None:
    """Each tier's copy of every listed checkpoint loads on its own: nothing listed lacks data."""
    for info in list_checkpoints(Store.of(hot, cold)):
        for tier in info.tiers:
            alone = (hot, None) if tier == "hot" else (None, cold)
            assert matches(load(*alone, step=info.step, options=ReaderOptions(lease=False))[0], info.step), (
                info,
                tier,
            )


def shard_per_block(model: torch.nn.Module, world: int) -> None:
    """FSDP2 on ``world`` CPU ranks: each of ``model.blocks``, then the root (as examples/train.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def forge_raw_item(root: str | Path, fqn: str, mutate: Any, name: str | None = None) -> None:
    """Rewrite the RawItem of ``fqn`` in a committed hot checkpoint's ``.metadata`` with
    ``mutate(item)`` and re-seal ``.metadata``'s entry and the manifest's checksum, as a store
    someone else can write would."""
    import json
    import pickle

    from tierstore.format.manifest import _checksum
    from tierstore.storage.checksum import crc32c_update

    mpath = Path(root, layout.manifest_key(name or layout.default_name(1)))
    body = json.loads(mpath.read_text())
    meta_path = Path(root, layout.file_key(body["name"], body["attempt"], ".metadata"))
    meta = pickle.loads(meta_path.read_bytes())
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    meta.storage_data[index] = mutate(meta.storage_data[index])
    data = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    meta_path.write_bytes(data)
    for entry in body["files"]:
        if entry["path"] == ".metadata":
            entry.update(size=len(data), crc32c=crc32c_update(0, data))
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    mpath.write_text(json.dumps(body))


def forge_metadata(root: str | Path, mutate: Any, name: str | None = None) -> None:
    """Rewrite a committed hot checkpoint's ``.metadata`` with ``mutate(metadata)`` (in place)
    and re-seal ``.metadata``'s entry and the manifest's checksum, as a store someone else can
    write would: the general form of :func:`forge_raw_item` (a flat manifest or a root)."""
    import json
    import pickle

    from tierstore.format.manifest import _checksum
    from tierstore.storage.checksum import crc32c_update

    mpath = Path(root, layout.manifest_key(name or layout.default_name(1)))
    body = json.loads(mpath.read_text())
    meta_path = Path(root, layout.file_key(body["name"], body["attempt"], ".metadata"))
    meta = pickle.loads(meta_path.read_bytes())
    mutate(meta)
    data = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    meta_path.write_bytes(data)
    entries = body["files"] if "files" in body else [body["metadata"]]  # flat, or a root
    for entry in entries:
        if entry["path"] == ".metadata":
            entry.update(size=len(data), crc32c=crc32c_update(0, data))
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    mpath.write_text(json.dumps(body))
