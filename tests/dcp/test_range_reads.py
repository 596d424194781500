"""Raw-encoded loads read only the byte ranges their plan needs, verified block by block.

Bytes are counted twice: by ``TieredReader.bytes_read`` and, independently, by a backend
that forwards every call to the real one (a local directory, or the S3 plugin against the
moto server) and counts what its streams deliver. Damage inside a wanted block is caught and
served from the next tier; damage outside every wanted range is not read at all, and
``tierstore verify`` (scrub) is what finds it.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import committed, file_path, flip, forge_raw_item, unwrap
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from tierstore import IntegrityError, ReaderOptions, TieredReader, TieredWriter
from tierstore.dcp import raw_read
from tierstore.format import encoding, layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.scrub import verify_store
from tierstore.storage import registry
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter

ROWS, COLS = 1024, 256  # 1 MiB of float32 per tensor
WINDOW = (256, 768)  # the rows of "b" a sliced load reads: half of it
DATA = layout.data_file_name(0, 0)


class _Counted(io.RawIOBase):
    """A stream that adds every byte it delivers to ``counts[key]``."""

    def __init__(self, stream: BinaryIO, counts: dict[str, int], key: str) -> None:
        super().__init__()
        self._stream, self._counts, self._key = stream, counts, key

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._stream.read(len(view))
        view[: len(data)] = data
        self._counts[self._key] = self._counts.get(self._key, 0) + len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


class CountingBackend(Backend):
    """``counted://<url>``: the backend of ``<url>``, counting the bytes read from each key
    and each request that opens a stream (``"read"`` whole, ``"range"``)."""

    scheme = "counted"
    BYTES: ClassVar[dict[str, int]] = {}
    OPENS: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url)
        self.inner = registry.open_backend(url.removeprefix("counted://"), options)
        self.spread_keys = self.inner.spread_keys  # type: ignore[misc]  # keys as the real tier's

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        return self.inner.open_write(key)

    def open_read(self, key: str) -> BinaryIO:
        self.OPENS.append(("read", key))
        return _Counted(self.inner.open_read(key), self.BYTES, key)  # type: ignore[return-value]

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        self.OPENS.append(("range", key))
        return _Counted(
            self.inner.open_range(key, offset, length),
            self.BYTES,  # type: ignore[return-value]
            key,
        )

    def publish(self, key: str, data: bytes) -> None:
        self.inner.publish(key, data)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.inner.delete_many(keys)

    def close(self) -> None:
        self.inner.close()

    @classmethod
    def reset(cls) -> None:
        cls.BYTES.clear()
        cls.OPENS.clear()


@pytest.fixture(autouse=True)
def _counting(registered_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    registered_backend("counted", CountingBackend)
    CountingBackend.reset()
    monkeypatch.setattr(encoding, "BLOCK", 16 << 10)  # 64 blocks a tensor: slices end inside some


class _Window(DefaultLoadPlanner):
    """Reads only rows ``WINDOW`` of each 2-D tensor; records the plan it hands the reader."""

    needed = 0

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        items = []
        for req in central_plan.items:
            if req.type == LoadItemType.BYTE_IO or len(req.lengths) != 2:
                items.append(req)
                continue
            lo, hi = WINDOW
            items.append(
                dataclasses.replace(
                    req,
                    storage_offsets=torch.Size([lo, 0]),
                    dest_offsets=torch.Size([lo, 0]),
                    lengths=torch.Size([hi - lo, req.lengths[1]]),
                )
            )
        plan = dataclasses.replace(super().finish_plan(central_plan), items=items)
        self.needed = plan_bytes(plan, self.metadata.storage_data)  # type: ignore[union-attr]
        return plan


def plan_bytes(plan: LoadPlan, storage: dict[Any, Any]) -> int:
    """The stored bytes ``plan``'s reads take: each region's elements, or a bytes item whole."""
    total = 0
    for req in plan.items:
        item = storage[req.storage_index]
        dtype = encoding.dtype_of(item.dtype)
        if req.type == LoadItemType.BYTE_IO or dtype is None:
            total += item.length
            continue
        total += dtype.itemsize * int(torch.Size(req.lengths).numel())
    return total


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(ROWS, COLS, generator=g) for k in ("a", "b", "c")}


def _save(hot: str, cold: str | None = None) -> Manifest:
    writer = TieredWriter(hot, cold, step=1)
    dcp.save(_state(), storage_writer=writer)
    if cold is not None:
        assert writer.migrator is not None and writer.migrator.wait(60)
    return committed(hot, 1)


def _load_window(
    hot: str | None, cold: str | None = None, **options: Any
) -> tuple[torch.Tensor, TieredReader, _Window]:
    """Load rows ``WINDOW`` of "b" alone."""
    target = {"b": torch.zeros(ROWS, COLS)}
    reader, planner = TieredReader(hot, cold, options=ReaderOptions(lease=False), **options), _Window()
    dcp.load(target, storage_reader=reader, planner=planner)
    return target["b"], reader, planner


def _window_of_b() -> torch.Tensor:
    want = torch.zeros(ROWS, COLS)
    want[WINDOW[0] : WINDOW[1]] = _state()["b"][WINDOW[0] : WINDOW[1]]
    return want


def _data_bytes(manifest: Manifest) -> int:
    """Bytes the counting backend delivered from the checkpoint's data file."""
    return sum(
        n for key, n in CountingBackend.BYTES.items() if key.endswith(f"/{DATA}") and manifest.attempt in key
    )


def _metadata_size(manifest: Manifest) -> int:
    entry = manifest.file(manifest.metadata_file)
    assert entry is not None
    return entry.size


def _item(root: str, manifest: Manifest, fqn: str) -> Any:
    meta = pickle.loads(file_path(root, manifest, ".metadata").read_bytes())
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


def test_a_sliced_load_from_a_local_tier_reads_its_plan(hot_dir: str) -> None:
    manifest = _save(hot_dir)
    loaded, reader, planner = _load_window(f"counted://{hot_dir}")
    assert torch.equal(loaded, _window_of_b())
    entry = manifest.file(DATA)
    assert entry is not None and planner.needed == (WINDOW[1] - WINDOW[0]) * COLS * 4
    assert entry.size > 5 * planner.needed  # a whole-file read could not pass what follows
    data = _data_bytes(manifest)
    assert planner.needed <= data <= 1.1 * planner.needed
    label = reader.tiers[0].label
    assert set(reader.bytes_read) == {label}
    assert reader.bytes_read[label] == data + _metadata_size(manifest)
    # One ranged request for the one range; the data file is never opened whole.
    assert [op for op, key in CountingBackend.OPENS if key.endswith(f"/{DATA}")] == ["range"]


def test_a_sliced_load_from_s3_reads_its_plan(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    cold = f"s3://{s3_bucket}/run"
    manifest = _save(str(tmp_path / "hot"), cold)
    loaded, reader, planner = _load_window(None, f"counted://{cold}")
    assert torch.equal(loaded, _window_of_b()) and reader.sources == {DATA: "cold", ".metadata": "cold"}
    data = _data_bytes(manifest)
    assert planner.needed <= data <= 1.1 * planner.needed
    assert sum(reader.bytes_read.values()) == data + _metadata_size(manifest)
    assert [op for op, key in CountingBackend.OPENS if key.endswith(f"/{DATA}")] == ["range"]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_whole_load_reads_each_byte_once(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(raw_read, "SPLIT_MIN", 1)  # split the file over the threads
    cold = f"s3://{s3_bucket}/run"
    manifest = _save(str(tmp_path / "hot"), cold)
    target = {k: torch.zeros(ROWS, COLS) for k in ("a", "b", "c")}
    reader = TieredReader(None, f"counted://{cold}", options=ReaderOptions(lease=False, thread_count=threads))
    dcp.load(target, storage_reader=reader)
    assert all(torch.equal(target[k], v) for k, v in _state().items())
    entry = manifest.file(DATA)
    assert entry is not None and _data_bytes(manifest) == entry.size
    ranges = [op for op, key in CountingBackend.OPENS if key.endswith(f"/{DATA}")]
    assert ranges == ["range"] * threads


def test_a_flipped_byte_in_a_wanted_block_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = _save(hot, cold)
    b = _item(hot, manifest, "b")
    flip(file_path(hot, manifest), b.offset + WINDOW[0] * COLS * 4 + 100)
    loaded, reader, _ = _load_window(hot, cold)
    assert torch.equal(loaded, _window_of_b()) and reader.sources[DATA] == "cold"


def test_a_flipped_byte_outside_every_wanted_range_is_not_read(hot_dir: str) -> None:
    manifest = _save(hot_dir)
    b = _item(hot_dir, manifest, "b")
    # In the rows after the window, past the coalescing distance: no request covers it.
    damaged = b.offset + WINDOW[1] * COLS * 4 + raw_read.COALESCE + encoding.BLOCK
    flip(file_path(hot_dir, manifest), damaged)
    loaded, reader, planner = _load_window(f"counted://{hot_dir}")
    assert torch.equal(loaded, _window_of_b()) and reader.sources[DATA] == "hot"
    assert _data_bytes(manifest) <= 1.1 * planner.needed
    # Loads verify what they read; `tierstore verify` (scrub) reads every byte and finds it.
    checks = {c.file: c for c in verify_store(hot_dir)}
    assert checks[".metadata"].ok and not checks[DATA].ok
    assert "CRC32C mismatch" in (checks[DATA].problem or "")


@pytest.mark.parametrize("where", ["past the end", "negative"])
def test_a_hostile_offset_is_refused_before_any_data_is_read(hot_dir: str, where: str) -> None:
    manifest = _save(hot_dir)
    entry = manifest.file(DATA)
    assert entry is not None
    offset = entry.size + 4096 if where == "past the end" else -4096
    forge_raw_item(hot_dir, "b", lambda item: dataclasses.replace(item, offset=offset))
    with pytest.raises(BaseException) as info:
        _load_window(f"counted://{hot_dir}")
    err = unwrap(info.value)
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == manifest.name and err.file in (DATA, ".metadata"), err
    assert _data_bytes(manifest) == 0
