"""The raw encoding: every dtype round trips, loads land in the destination's own memory
without torch.load, partial and resharded reads verify the blocks they touch, damage falls
back to a verified cold copy, and hostile RawItems are clean IntegrityErrors."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import blank, committed, file_path, flip, forge_raw_item, load, save, state_for, unwrap
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from tierstore import (
    ConfigError,
    IntegrityError,
    ReaderOptions,
    TieredReader,
    TieredWriter,
    WriterOptions,
    list_checkpoints,
)
from tierstore.dcp import raw_read
from tierstore.errors import ChecksumMismatch
from tierstore.format import encoding, layout
from tierstore.format.encoding import RawItem

NAME = layout.default_name(1)
DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _every_dtype() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {}
    for dtype in DTYPES:
        name = encoding.dtype_name(dtype)
        base = torch.randn(6, 5, generator=g, dtype=torch.float64) * 50
        state[name] = (base > 0) if dtype == torch.bool else base.to(dtype)
        state[f"{name}.scalar"] = state[name][2, 3].clone()  # 0-dim
        state[f"{name}.empty"] = torch.empty(0, 4, dtype=dtype)
        state[f"{name}.strided"] = state[name].t()[1:, ::2]  # a non-contiguous view
    state["extra"] = {"step": 3, "names": ["a", "b"]}
    return state


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "names": []}
        for k, v in state.items()
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit for bit (float8 has no torch.equal; NaNs never compare equal).
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return (
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        if a.dim()
        else torch.equal(a.reshape(1).view(torch.uint8), b.reshape(1).view(torch.uint8))
    )


@pytest.mark.parametrize("threads", [1, 3])
def test_every_dtype_round_trips(hot_dir: str, threads: int, monkeypatch) -> None:
    monkeypatch.setattr(raw_read, "SPLIT_MIN", 1)  # split even a small file over the threads
    state = _every_dtype()
    dcp.save(state, storage_writer=TieredWriter(hot_dir, step=1, thread_count=threads))
    target = _zeros_like(state)
    reader = TieredReader(hot_dir, options=ReaderOptions(thread_count=threads))
    dcp.load(target, storage_reader=reader)
    assert target["extra"] == state["extra"]
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert _same(target[key], value), key
    assert reader.manifest is not None and reader.manifest.encoding == "raw"


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tier_without_file_descriptors_reads_by_seeking(monkeypatch, threads: int) -> None:
    # The memory backend's objects are seekable streams, not files: no positional reads.
    monkeypatch.setattr(encoding, "BLOCK", 4096)
    monkeypatch.setattr(raw_read, "SPLIT_MIN", 1)
    url = f"memory://raw-seek-{threads}"
    state = state_for(1, (301, 33))
    dcp.save(state, storage_writer=TieredWriter(url, step=1))
    target = blank((301, 33))
    dcp.load(
        target,
        storage_reader=TieredReader(url, options=ReaderOptions(thread_count=threads)),
        planner=_Halves(1),
    )
    assert torch.equal(target["w"], state["w"]) and target["extra"] == state["extra"]


def test_loads_land_in_the_destination_memory_without_torch_load(hot_dir: str, monkeypatch) -> None:
    state = {"w": torch.randn(300, 70), "h": torch.randn(5).to(torch.bfloat16), "s": torch.tensor(7)}
    dcp.save(state, storage_writer=TieredWriter(hot_dir, step=1))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in target.items()}
    calls = []
    real_load = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    dcp.load(target, storage_reader=TieredReader(hot_dir))
    assert calls == []
    assert {k: v.data_ptr() for k, v in target.items()} == pointers
    assert all(torch.equal(target[k], state[k]) for k in state)


class _Halves(DefaultLoadPlanner):
    """Reads each 2-D tensor as two halves along ``dim`` (``keep``: only these halves), so
    the reader sees slices of stored items: dim 0 slices and non-contiguous column ones."""

    def __init__(self, dim: int, keep: tuple[int, ...] = (0, 1)) -> None:
        super().__init__()
        self.dim, self.keep = dim, keep

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO or len(req.lengths) != 2:
                items.append(req)
                continue
            half = req.lengths[self.dim] // 2
            for part, (start, size) in enumerate([(0, half), (half, req.lengths[self.dim] - half)]):
                if part in self.keep:
                    items.append(
                        dataclasses.replace(
                            req,
                            storage_offsets=_bump(req.storage_offsets, self.dim, start),
                            dest_offsets=_bump(req.dest_offsets, self.dim, start),
                            lengths=_put(req.lengths, self.dim, size),
                        )
                    )
        return dataclasses.replace(plan, items=items)


def _bump(size: torch.Size, dim: int, by: int) -> torch.Size:
    return _put(size, dim, size[dim] + by)


def _put(size: torch.Size, dim: int, value: int) -> torch.Size:
    values = list(size)
    values[dim] = value
    return torch.Size(values)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("keep", [(0, 1), (0,), (1,)])
def test_slices_of_stored_items_load_verified(
    hot_dir: str, monkeypatch, dim: int, keep: tuple[int, ...]
) -> None:
    monkeypatch.setattr(encoding, "BLOCK", 4096)  # many blocks: slices start and end inside some
    state = state_for(1, (301, 33))
    save(hot_dir, 1, shape=(301, 33))
    target = blank((301, 33))
    dcp.load(target, storage_reader=TieredReader(hot_dir), planner=_Halves(dim, keep))
    want = torch.zeros(301, 33)
    for part in keep:
        rows = slice(0, 150) if part == 0 else slice(150, None)
        region = (
            (rows, slice(None)) if dim == 0 else (slice(None), slice(0, 16) if part == 0 else slice(16, None))
        )
        want[region] = state["w"][region]
    assert torch.equal(target["w"], want)
    assert torch.equal(target["i"], state["i"]) and target["extra"] == state["extra"]


def test_a_different_destination_dtype_is_converted(hot_dir: str) -> None:
    save(hot_dir, 1)
    target = {
        **blank(),
        "w": torch.zeros(64, 33, dtype=torch.float64),
        "b": torch.zeros(7),
        "i": torch.zeros(10, dtype=torch.int32),
    }
    dcp.load(target, storage_reader=TieredReader(hot_dir))
    state = state_for(1)
    assert torch.equal(target["w"], state["w"].double()) and torch.equal(target["b"], state["b"].float())
    assert torch.equal(target["i"], state["i"].int()) and target["extra"] == state["extra"]


def test_the_manifest_records_the_encoding(hot_dir: str, tmp_path: Path) -> None:
    raw = save(hot_dir, 1).manifest
    assert raw is not None and raw.encoding == "raw"
    assert json.loads(Path(hot_dir, layout.manifest_key(raw.name)).read_bytes())["encoding"] == "raw"
    plain = save(str(tmp_path / "plain"), 1, options=WriterOptions(encoding="dcp")).manifest
    assert plain is not None and plain.encoding == "dcp"
    # Absent for dcp: manifests stay exactly what older tierstore versions wrote and read.
    assert "encoding" not in json.loads(Path(tmp_path, "plain", layout.manifest_key(plain.name)).read_bytes())
    state, _ = load(str(tmp_path / "plain"))
    assert torch.equal(state["w"], state_for(1)["w"]) and state["extra"] == state_for(1)["extra"]


def test_an_unknown_encoding_is_refused(hot_dir: str) -> None:
    with pytest.raises(ValueError, match="encoding"):
        TieredWriter(hot_dir, step=1, options=WriterOptions(encoding="zip"))


def _big(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(3 << 20, generator=g), "small": torch.arange(5), "extra": {"step": step}}


def _save_big(hot: str, cold: str | None) -> tuple[Any, Path]:
    writer = TieredWriter(hot, cold, step=1)
    dcp.save(_big(1), storage_writer=writer)
    if cold is not None:
        assert writer.migrator is not None and writer.migrator.wait(30)
    manifest = committed(hot, 1)
    meta = pickle.loads(file_path(hot, manifest, ".metadata").read_bytes())
    return meta, file_path(hot, manifest)


def _middle_of(meta: Any, fqn: str) -> int:
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    return int(info.offset + info.length // 2)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_flipped_byte_in_a_large_item_falls_back_to_cold(
    tmp_path: Path, caplog, monkeypatch, threads: int
) -> None:
    monkeypatch.setattr(raw_read, "SPLIT_MIN", 1)
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    meta, path = _save_big(hot, cold)
    flip(path, _middle_of(meta, "big"))
    target = {"big": torch.zeros(3 << 20), "small": torch.zeros(5, dtype=torch.long), "extra": {"step": 0}}
    reader = TieredReader(hot, cold, options=ReaderOptions(thread_count=threads))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        dcp.load(target, storage_reader=reader)
    assert torch.equal(target["big"], _big(1)["big"]) and reader.sources[path.name] == "cold"
    assert target["extra"] == {"step": 1}
    assert "falling back" in caplog.text and path.name in caplog.text


def test_damage_in_every_tier_is_the_files_mismatch(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    meta, path = _save_big(hot, cold)
    manifest = committed(cold, 1, "cold")
    for root in (hot, cold):
        flip(file_path(root, manifest), _middle_of(meta, "big"))
    target = {"big": torch.zeros(3 << 20), "small": torch.zeros(5, dtype=torch.long), "extra": {"step": 0}}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=TieredReader(hot, cold))
    err = unwrap(info.value)
    entry = manifest.file(path.name)
    assert isinstance(err, ChecksumMismatch) and entry is not None
    assert (err.checkpoint, err.file, err.tier) == (manifest.name, path.name, f"cold {cold}")
    # The file's mismatch, as scrub and transfer report the same damage.
    assert err.expected == f"{entry.crc32c:08x}" and str(err).startswith("CRC32C mismatch")


def test_a_partial_read_verifies_the_blocks_it_touches(hot_dir: str, monkeypatch) -> None:
    monkeypatch.setattr(encoding, "BLOCK", 4096)
    save(hot_dir, 1, shape=(301, 33))
    manifest = committed(hot_dir, 1)
    meta = pickle.loads(file_path(hot_dir, manifest, ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "w")
    flip(file_path(hot_dir, manifest), info.offset + 10)  # in the rows the first half reads
    target = blank((301, 33))
    with pytest.raises(BaseException) as info_:
        dcp.load(target, storage_reader=TieredReader(hot_dir), planner=_Halves(0, keep=(0,)))
    err = unwrap(info_.value)
    assert isinstance(err, ChecksumMismatch) and err.file == "__0_0.distcp", err


def test_damage_in_padding_is_caught_by_a_whole_file_load(hot_dir: str, monkeypatch) -> None:
    monkeypatch.setattr(raw_read, "SPLIT_MIN", 1)
    save(hot_dir, 1)
    manifest = committed(hot_dir, 1)
    meta = pickle.loads(file_path(hot_dir, manifest, ".metadata").read_bytes())
    first = min(meta.storage_data.values(), key=lambda v: v.offset)
    flip(file_path(hot_dir, manifest), first.offset + first.length)  # the padding after it
    for threads in (1, 3):
        with pytest.raises(BaseException) as info:
            load(hot_dir, options=ReaderOptions(thread_count=threads))
        err = unwrap(info.value)
        assert isinstance(err, ChecksumMismatch) and err.file == "__0_0.distcp", err


# -- hostile RawItems --------------------------------------------------------------------


HOSTILE: dict[str, Callable[[RawItem], RawItem]] = {
    "length not numel * itemsize": lambda i: dataclasses.replace(i, length=i.length - 4),
    "past the end of the file": lambda i: dataclasses.replace(i, offset=i.offset + (1 << 30)),
    "too few block checksums": lambda i: dataclasses.replace(i, crc32c=()),
    "too many block checksums": lambda i: dataclasses.replace(i, crc32c=i.crc32c * 2),
    "unknown dtype": lambda i: dataclasses.replace(i, dtype="float99"),
    "dtype of another size": lambda i: dataclasses.replace(i, dtype="float64"),
    "shape not ints": lambda i: dataclasses.replace(i, shape=("64", 33)),
    "shape of another size": lambda i: dataclasses.replace(i, shape=(33, 64, 2)),
    "negative offset": lambda i: dataclasses.replace(i, offset=-4096),
    "zero block": lambda i: dataclasses.replace(i, block=0),
    "checksum out of range": lambda i: dataclasses.replace(i, crc32c=(1 << 40,)),
    "shifted offset": lambda i: dataclasses.replace(i, offset=i.offset + 4),
    "path not a string": lambda i: dataclasses.replace(i, relative_path=7),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_raw_items_are_clean_integrity_errors(hot_dir: str, case: str) -> None:
    save(hot_dir, 1)
    forge_raw_item(hot_dir, "w", HOSTILE[case], NAME)
    with pytest.raises(BaseException) as info:
        load(hot_dir, name=NAME)
    err = unwrap(info.value)
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == NAME and err.file in (".metadata", "__0_0.distcp"), err
    assert err.tier == f"hot {hot_dir}", err


def test_a_tensor_with_no_raw_encoding_fails_the_save_naming_it(tmp_path: Path) -> None:
    quantized = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"q": quantized}, storage_writer=TieredWriter(str(tmp_path), step=1))
    error = unwrap(caught.value)
    assert isinstance(error, ConfigError) and "'q'" in str(error) and "encoding='dcp'" in str(error)
    dcp.save(
        {"q": quantized},
        storage_writer=TieredWriter(str(tmp_path), step=2, options=WriterOptions(encoding="dcp")),
    )
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]


@pytest.fixture
def crc_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread each ``encoding.block_crcs`` call ran on, in order."""
    import threading

    names: list[str] = []
    crcs = encoding.block_crcs

    def block_crcs(view: memoryview, block: int) -> tuple[int, ...]:
        names.append(threading.current_thread().name)
        return crcs(view, block)

    monkeypatch.setattr(encoding, "block_crcs", block_crcs)
    return names


@pytest.mark.parametrize(
    ("ahead", "ahead_min"),
    [(True, 0), (True, 16 << 10), (False, 0)],
    ids=["every-item-ahead", "small-items-inline", "all-inline"],
)
def test_pipelined_checksums_write_what_one_item_at_a_time_writes(
    monkeypatch: pytest.MonkeyPatch, crc_threads: list[str], ahead: bool, ahead_min: int
) -> None:
    from tierstore.storage.memory import MemoryBackend

    monkeypatch.setattr(encoding, "BLOCK", 1 << 12)  # several blocks per item
    monkeypatch.setattr(encoding, "_AHEAD_MIN", ahead_min)  # 3000 floats are 12 KiB, 5000 20 KiB
    items = [torch.arange(n, dtype=torch.float32) for n in (0, 1, 3000, 5000)] + [io.BytesIO(b"x" * 9)]
    resolved: list[int] = []
    backend = MemoryBackend("memory://raw-pipeline")
    with backend.open_write("one") as one:
        expected = [encoding.write_item(one, item, "f") for item in items]

    def resolve(item: Any) -> Any:
        resolved.append(len(resolved))
        return item

    crc_threads.clear()
    with backend.open_write("piped") as piped:
        placed = encoding.write_items(piped, items, resolve, "f", ahead=ahead)
    assert placed == expected and resolved == list(range(len(items)))
    helper = [name.startswith("tierstore-crc") for name in crc_threads]
    assert helper == [
        ahead and len(memoryview(encoding.item_view(item, "f")[0])) >= ahead_min for item in items
    ]
    assert backend.read_bytes("piped") == backend.read_bytes("one")
    assert (piped.size, piped.crc32c) == (one.size, one.crc32c)


def test_a_save_on_the_main_thread_checksums_ahead_and_one_elsewhere_checksums_inline(
    tmp_path: Path, crc_threads: list[str]
) -> None:
    import threading

    threads = crc_threads
    state = {"big": torch.rand(64 << 10), "small": torch.rand(8)}  # 256 KiB, above _AHEAD_MIN

    def save(step: int) -> None:
        dcp.save(state, storage_writer=TieredWriter(hot=str(tmp_path), step=step), no_dist=True)

    save(1)  # the caller waits for it: the big item's checksums on the helper thread
    assert any(name.startswith("tierstore-crc") for name in threads), threads
    threads.clear()
    background = threading.Thread(target=save, args=(2,), name="async-save")
    background.start()
    background.join()
    assert threads and set(threads) == {"async-save"}  # off training's path: one thread
    into = {"big": torch.zeros(64 << 10), "small": torch.zeros(8)}
    for step in (1, 2):
        dcp.load(into, storage_reader=TieredReader(hot=str(tmp_path), step=step), no_dist=True)
        assert all(torch.equal(into[k], state[k]) for k in state)  # both verify
