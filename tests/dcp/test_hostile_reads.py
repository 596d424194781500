"""Read-side defects an outside test found (issue 22, item 5), each on real local stores.

A forged, re-sealed ``.metadata`` whose chunks leave part of a tensor uncovered, or whose
``RawItem`` s alias each other or disagree with their tensor, is refused by the load and
reported by ``tierstore verify``, never loaded as "success" with stale or foreign bytes.
A reader without a name skips a two-level checkpoint that lost a part, or a shard whose
place a same-size stray took, and ``tierstore verify`` reports every damaged checkpoint.
A ``BYTE_IO`` item of a type outside torch's ``weights_only`` allow-list is a refusal by
policy (:class:`~tierstore.errors.UnsafeType`) naming the type and how to allow it, never
damage that a resume would silently step back from.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import committed, file_path, forge_metadata, forge_raw_item, load_error, saved, unwrap
from simulated_ranks import holds_saved, load_state, save_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tierstore import (
    CheckpointManager,
    IntegrityError,
    ReaderOptions,
    Retention,
    StagingOptions,
    TieredReader,
    TieredWriter,
    WriterOptions,
    errors,
)
from tierstore.cli import main
from tierstore.dcp.reader import is_damage
from tierstore.format import layout
from tierstore.format.encoding import RawItem
from tierstore.format.safe_pickle import load_metadata
from tierstore.lifecycle.scrub import verify_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAME = layout.default_name(1)


def _pair() -> dict[str, Any]:
    """Two tensors of one dtype and shape: a RawItem of one could pass for the other's."""
    return {
        "x": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "y": -torch.arange(32, dtype=torch.float32).reshape(8, 4),
    }


def _save_pair(hot_dir: str) -> None:
    dcp.save(_pair(), storage_writer=TieredWriter(hot_dir, step=1))


def _raw(hot_dir: str, fqn: str) -> RawItem:
    meta = pickle.loads(file_path(hot_dir, committed(hot_dir, 1), ".metadata").read_bytes())
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


def _load_only_x(hot_dir: str, **options: Any) -> torch.Tensor:
    target = {"x": torch.full((8, 4), 7.0)}
    dcp.load(
        target,
        storage_reader=TieredReader(hot_dir, **options),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    return target["x"]


def _checks(hot_dir: str) -> dict[str, Any]:
    return {c.file: c for c in verify_store(hot_dir)}


# -- 1. metadata that does not cover, alias or match its tensors ------------------------------


def _half_chunk(meta: Metadata) -> None:
    """``w``'s one chunk now claims rows 0-31 only: rows 32-63 are read from nowhere."""
    tensor = meta.state_dict_metadata["w"]
    tensor.chunks[0] = dataclasses.replace(tensor.chunks[0], sizes=torch.Size([32, 33]))


@pytest.mark.parametrize("named", [True, False])
def test_chunks_that_leave_part_of_a_tensor_uncovered_are_refused(hot_dir: str, named: bool) -> None:
    saved(hot_dir, 1)
    forge_metadata(hot_dir, _half_chunk)
    err = load_error(hot_dir, name=NAME if named else None, options=ReaderOptions(lease=False))
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == NAME and err.file == ".metadata" and err.tier == f"hot {hot_dir}", err
    assert "'w'" in str(err) and "cover" in str(err), err


def test_a_raw_item_of_another_dtype_than_its_tensor_is_refused(hot_dir: str) -> None:
    saved(hot_dir, 1)
    # Same item size, length and block checksums: only the tensor's metadata says float32.
    forge_raw_item(hot_dir, "w", lambda item: dataclasses.replace(item, dtype="int32"))
    err = load_error(hot_dir, name=NAME, options=ReaderOptions(lease=False))
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == NAME and "'w'" in str(err) and "int32" in str(err), err
    assert not _checks(hot_dir)[".metadata"].ok


def test_an_alias_of_another_items_bytes_is_refused_by_a_partial_load(hot_dir: str) -> None:
    _save_pair(hot_dir)
    y = _raw(hot_dir, "y")
    forge_raw_item(hot_dir, "x", lambda item: y)  # x's entry now names y's bytes, checksums and all
    with pytest.raises(BaseException) as info:
        _load_only_x(hot_dir, name=NAME, options=ReaderOptions(lease=False))
    err = unwrap(info.value)
    assert isinstance(err, IntegrityError), f"{type(err).__name__}: {err}"
    assert err.checkpoint == NAME and err.tier == f"hot {hot_dir}", err
    assert "overlap" in str(err) and "'x'" in str(err) and "'y'" in str(err), err


def test_verify_checks_every_raw_item_against_its_data_file(hot_dir: str) -> None:
    _save_pair(hot_dir)
    data = layout.data_file_name(0, 0)
    assert all(c.ok for c in verify_store(hot_dir))
    # A block checksum that no longer matches the bytes (the file's own CRC32C still does).
    forge_raw_item(hot_dir, "x", lambda item: dataclasses.replace(item, crc32c=(item.crc32c[0] ^ 1,)))
    check = _checks(hot_dir)[data]
    assert not check.ok and "'x'" in (check.problem or "") and "block" in (check.problem or ""), check
    # An item past the end of its file.
    forge_raw_item(hot_dir, "x", lambda item: dataclasses.replace(item, offset=item.offset + (1 << 20)))
    check = _checks(hot_dir)[data]
    assert not check.ok and "past the end" in (check.problem or ""), check


def test_verify_reports_an_alias_and_an_uncovered_tensor(tmp_path: Path) -> None:
    alias, uncovered = str(tmp_path / "alias"), str(tmp_path / "uncovered")
    _save_pair(alias)
    y = _raw(alias, "y")
    forge_raw_item(alias, "x", lambda item: y)
    saved(uncovered, 1)
    forge_metadata(uncovered, _half_chunk)
    for store, words in ((alias, ("overlap", "'x'")), (uncovered, ("cover", "'w'"))):
        checks = _checks(store)
        meta = checks[".metadata"]
        assert not meta.ok and all(w in (meta.problem or "") for w in words), meta


def _metadata(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bytes:
    """A pickled Metadata of one float32 tensor ``t`` stored in ``chunks`` (offsets, sizes),
    each a genuine RawItem of its own bytes in one file, one after the other."""
    storage, offset = {}, 0
    for offsets, sizes in chunks:
        length = 4 * int(torch.Size(sizes).numel())
        crcs = (0,) * -(-length // (4 << 20))
        storage[MetadataIndex("t", offsets)] = RawItem("f", offset, length, "float32", sizes, 4 << 20, crcs)
        offset += -(-length // 4096) * 4096 or 4096
    tensor = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    return pickle.dumps(Metadata({"t": tensor}, storage_data=storage))


@pytest.mark.parametrize(
    "size, chunks, covered",
    [
        ((10,), [((0,), (10,))], True),
        ((10,), [((0,), (4,)), ((4,), (6,))], True),
        ((4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)], True),  # a 2 x 2 grid
        ((6, 4), [((0, 0), (6, 2)), ((0, 2), (6, 2))], True),  # sharded along dim 1
        ((3, 2), [((0, 0), (1, 2)), ((1, 0), (2, 2)), ((3, 0), (0, 2))], True),  # an empty shard
        ((), [((), ())], True),
        ((10,), [((0,), (4,)), ((6,), (4,))], False),  # a gap
        ((10,), [((0,), (5,)), ((3,), (5,))], False),  # overlap and gap: the volume adds up
        ((4, 6), [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (2, 3)), ((0, 3), (2, 3))], False),
    ],
)
def test_chunks_must_tile_their_tensor(size: tuple[int, ...], chunks: Any, covered: bool) -> None:
    data = _metadata(size, chunks)
    if covered:
        load_metadata(data)
    else:
        with pytest.raises(pickle.UnpicklingError, match="'t'"):
            load_metadata(data)


# -- 2. a reader without a name skips, verify reports each -------------------------------------


def _two_level(hot: str, step: int):  # type: ignore[no-untyped-def]
    manifest, _ = save_ranks(2, hot, step=step, options=WriterOptions(manifest_part_ranks=1))
    assert manifest.parts, "expected a two-level manifest"
    return manifest


def _drop_part(hot: str, manifest: Any) -> Path:
    part = Path(hot, layout.file_key(manifest.name, manifest.attempt, manifest.parts[1].path))
    part.unlink()
    return part


def _swap_shard_for_stray(hot: str, manifest: Any) -> None:
    victim = manifest.files_of_rank(1)[0]
    shard = Path(hot, layout.file_key(manifest.name, manifest.attempt, victim.path))
    stray = shard.with_name("stray.distcp")
    stray.write_bytes(bytes(shard.stat().st_size))  # same size: the listing's totals add up
    shard.unlink()


DAMAGE = {"part missing": _drop_part, "shard replaced by a same-size stray": _swap_shard_for_stray}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_reader_without_a_name_skips_a_damaged_two_level_checkpoint(
    hot_dir: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _two_level(hot_dir, 1)
    newest = _two_level(hot_dir, 2)
    DAMAGE[damage](hot_dir, newest)
    state = load_state(2, step=1)
    reader = TieredReader(hot_dir, options=ReaderOptions(lease=False))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        dcp.load(state, storage_reader=reader)
    assert reader.manifest is not None and reader.manifest.step == 1 and holds_saved(state, 2, step=1)
    warned = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and newest.name in warned[0], warned
    # Named, it raises, naming the checkpoint.
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            load_state(2, step=2),
            storage_reader=TieredReader(hot_dir, name=newest.name, options=ReaderOptions(lease=False)),
        )
    err = unwrap(info.value)
    assert is_damage(err) and err.checkpoint == newest.name, f"{type(err).__name__}: {err}"


def test_verify_reports_every_damaged_checkpoint_and_goes_on(
    hot_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_level(hot_dir, 1)
    _drop_part(hot_dir, _two_level(hot_dir, 2))
    _swap_shard_for_stray(hot_dir, _two_level(hot_dir, 3))
    _drop_part(hot_dir, _two_level(hot_dir, 4))
    checks = verify_store(hot_dir)
    bad = {c.checkpoint for c in checks if not c.ok}
    assert bad == {layout.default_name(s) for s in (2, 3, 4)}, checks
    assert all(c.ok for c in checks if c.checkpoint == layout.default_name(1))
    parts = [c for c in checks if not c.ok and c.file == "<manifest>"]
    assert {c.checkpoint for c in parts} == {layout.default_name(s) for s in (2, 4)}
    assert all("part" in (c.problem or "") for c in parts), parts
    assert main(["verify", "--hot", hot_dir]) == 1
    out = capsys.readouterr().out
    assert all(layout.default_name(s) in out for s in (2, 3, 4)), out


def test_verify_of_a_named_checkpoint_with_a_missing_part_reports_it(
    hot_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _drop_part(hot_dir, _two_level(hot_dir, 1))
    assert main(["verify", "--hot", hot_dir, "--name", NAME]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and NAME in out and "part" in out, out


def test_verify_of_a_name_invalid_in_one_tier_reports_it_and_checks_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    saved(hot, 1)
    shutil.copytree(hot, cold)  # a local cold tier: the same layout, committed by its manifest
    root = Path(hot, layout.manifest_key(NAME))
    root.write_bytes(root.read_bytes()[:40])  # torn in hot only
    assert main(["verify", "--hot", hot, "--cold", cold, "--name", NAME]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  hot {hot}  {NAME}  <manifest>" in out, out
    assert "verified 3 files: 2 ok, 1 damaged" in out, out


# -- 3. a type outside torch's allow-list is a refusal by policy, not damage ------------------


@dataclass
class Settings:
    depth: int


def _resume(hot_dir: str, states: list[dict[str, Any]], target: dict[str, Any]) -> int | None:
    with CheckpointManager(
        hot_dir, retention=Retention(hot_min_free=None), staging=StagingOptions(async_save=False)
    ) as manager:
        for step, state in enumerate(states, 1):
            manager.save(step, state, force=True)
        manager.wait()
        return manager.load_latest(target)


def _refusal(
    hot_dir: str, states: list[dict[str, Any]], target: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> errors.UnsafeType:
    with caplog.at_level(logging.WARNING, logger="tierstore"), pytest.raises(CheckpointException) as info:
        _resume(hot_dir, states, target)
    err = unwrap(info.value)
    assert isinstance(err, errors.UnsafeType), f"{type(err).__name__}: {err}"
    assert not isinstance(err, IntegrityError) and not is_damage(info.value)
    assert "is damaged" not in caplog.text  # no step back to an older checkpoint
    assert "add_safe_globals" in str(err) and err.checkpoint == layout.default_name(2), err
    again = pickle.loads(pickle.dumps(err))  # it crosses ranks inside DCP's CheckpointException
    assert type(again) is type(err) and again.types == err.types and str(again) == str(err)
    return err


def test_a_bytesio_in_the_state_is_refused_by_default_and_loads_once_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # PyTorch's own DCP e2e state holds an io.BytesIO; torch's weights_only does not allow it.
    states = [{"w": torch.ones(3) * s, "blob": io.BytesIO(b"step %d" % s)} for s in (1, 2)]
    err = _refusal(str(tmp_path / "a"), states, {"w": torch.zeros(3), "blob": io.BytesIO()}, caplog)
    assert "_io.BytesIO" in str(err) and "'blob'" in str(err) and err.types == ("_io.BytesIO",)
    target = {"w": torch.zeros(3), "blob": io.BytesIO()}
    with torch.serialization.safe_globals([io.BytesIO]):
        assert _resume(str(tmp_path / "b"), states, target) == 2
    assert target["blob"].getvalue() == b"step 2" and torch.equal(target["w"], torch.ones(3) * 2)


def test_a_custom_class_is_refused_naming_it_never_stepping_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    states = [{"w": torch.ones(3), "cfg": 1}, {"w": torch.ones(3) * 2, "cfg": Settings(2)}]
    err = _refusal(str(tmp_path / "a"), states, {"w": torch.zeros(3), "cfg": None}, caplog)
    qualname = f"{Settings.__module__}.{Settings.__qualname__}"
    assert qualname in str(err) and err.types == (qualname,), err
    target: dict[str, Any] = {"w": torch.zeros(3), "cfg": None}
    with torch.serialization.safe_globals([Settings]):
        assert _resume(str(tmp_path / "b"), states, target) == 2
    assert target["cfg"] == Settings(2)


def _refused_load(hot_dir: str) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"w": torch.zeros(3), "cfg": None},
            storage_reader=TieredReader(hot_dir, options=ReaderOptions(lease=False)),
        )
    return unwrap(info.value)


def test_a_refused_type_is_the_same_error_from_a_plain_reader(hot_dir: str) -> None:
    dcp.save({"w": torch.ones(3), "cfg": Settings(1)}, storage_writer=TieredWriter(hot_dir, step=1))
    err = _refused_load(hot_dir)
    assert isinstance(err, errors.UnsafeType) and err.checkpoint == NAME, f"{type(err).__name__}: {err}"
    assert err.file == layout.data_file_name(0, 0) and err.tier == f"hot {hot_dir}", err


def test_dcp_encoded_refusal_is_an_unsafe_type_too(hot_dir: str) -> None:
    dcp.save(
        {"w": torch.ones(3), "cfg": Settings(1)},
        storage_writer=TieredWriter(hot_dir, step=1, options=WriterOptions(encoding="dcp")),
    )
    err = _refused_load(hot_dir)
    assert isinstance(err, errors.UnsafeType) and "Settings" in str(err), f"{type(err).__name__}: {err}"
