"""``tierstore.export``: a committed checkpoint out of the store as Hugging Face safetensors,
one ``torch.save`` file or a plain DCP checkpoint, each read back by its own ecosystem's
reader and compared bit for bit; and DCP's own reader on a raw checkpoint, which must say
what reads it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import blank, committed, file_path, flip, matches, save, state_for
from safetensors.torch import load_file
from torch.distributed.checkpoint import format_utils

import tierstore
from tierstore import ConfigError, Store, WriterOptions
from tierstore.dcp.export import SAFETENSORS_INDEX, TORCH_FILE
from tierstore.errors import ChecksumMismatch, IntegrityError
from tierstore.format import layout

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ENCODINGS = ("raw", "dcp")
FIX = ("tierstore export --format dcp", "TieredReader", 'WriterOptions(encoding="dcp")')


def read_safetensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors export, shard by shard through its index."""
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        shard = load_file(out / file)
        assert all(index["weight_map"][key] == file for key in shard)
        tensors.update(shard)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- DCP's own reader on tierstore's raw encoding ---------------------------------------------


def test_dcp_filesystem_reader_on_a_raw_checkpoint_names_the_fix(hot_dir: str, tmp_path: Path) -> None:
    save(hot_dir, 3)
    attempt = file_path(hot_dir, committed(hot_dir, 3)).parent
    assert (attempt / ".metadata").is_file()
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.load(blank(), storage_reader=dcp.FileSystemReader(attempt), no_dist=True)
    assert type(info.value).__name__ == "CheckpointException"
    text = str(info.value)
    assert "tierstore's raw encoding" in text and all(fix in text for fix in FIX), text
    assert layout.data_file_name(0, 0) in text  # the file it was reading
    with pytest.raises(BaseException) as info:
        format_utils.dcp_to_torch_save(attempt, tmp_path / "out.pt")
    assert "tierstore's raw encoding" in str(info.value) and all(fix in str(info.value) for fix in FIX)
    assert not (tmp_path / "out.pt").exists()


def test_tierstore_still_reads_raw_and_dcp_reads_a_dcp_encoded_attempt(hot_dir: str) -> None:
    # The attribute that refuses DCP's reader is no obstacle to tierstore's own.
    save(hot_dir, 1)
    save(hot_dir, 2, options=WriterOptions(encoding="dcp"))
    target = blank()
    dcp.load(target, storage_reader=tierstore.TieredReader(hot_dir, step=1), no_dist=True)
    assert matches(target, 1)
    target = blank()
    attempt = file_path(hot_dir, committed(hot_dir, 2)).parent
    dcp.load(target, storage_reader=dcp.FileSystemReader(attempt), no_dist=True)
    assert matches(target, 2)


# -- round trips, one process -----------------------------------------------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_format_round_trips_bit_exact(encoding: str, hot_dir: str, tmp_path: Path) -> None:
    save(hot_dir, 1, options=WriterOptions(encoding=encoding))
    save(hot_dir, 5, options=WriterOptions(encoding=encoding))
    want = state_for(5)

    st = tierstore.export(hot_dir, format="safetensors", out=tmp_path / "st")  # the newest
    assert (st.name, st.step, st.format) == (layout.default_name(5), 5, "safetensors")
    tensors = read_safetensors(tmp_path / "st")
    assert set(tensors) == {"w", "b", "i"} and all(same(tensors[k], want[k]) for k in tensors)
    assert st.skipped == ("extra.note", "extra.step") and st.files == ("model.safetensors", SAFETENSORS_INDEX)
    assert st.bytes == sum(want[k].numel() * want[k].element_size() for k in ("w", "b", "i"))

    tierstore.export(hot_dir, format="torch", out=tmp_path / "pt", step=5)
    loaded = torch.load(tmp_path / "pt" / TORCH_FILE, weights_only=True)
    assert loaded["extra"] == want["extra"] and all(same(loaded[k], want[k]) for k in ("w", "b", "i"))

    plain = tierstore.export(hot_dir, format="dcp", out=tmp_path / "dcp", name=layout.default_name(1))
    assert plain.step == 1
    target = blank()
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert matches(target, 1)
    back = tmp_path / "back.pt"  # DCP's own converter reads it too
    format_utils.dcp_to_torch_save(tmp_path / "dcp", back)
    assert same(torch.load(back, weights_only=True)["w"], state_for(1)["w"])


def test_shards_index_and_strip_prefix(hot_dir: str, tmp_path: Path) -> None:
    state = {
        "train": {"model": {f"layer{i}.weight": torch.randn(32, 16) for i in range(5)}},
        "other": torch.ones(3),
        "step": 9,
    }
    dcp.save(state, storage_writer=tierstore.TieredWriter(hot_dir, step=9), no_dist=True)
    layer = 32 * 16 * 4
    calls: list[tuple[str, int, int]] = []
    report = tierstore.export(
        hot_dir,
        format="safetensors",
        out=tmp_path / "st",
        strip_prefix="train.model.",
        max_shard_size=2 * layer,
        progress=lambda *call: calls.append(call),
    )
    # Progress counts the bytes of the tensors exported, one shard's load after another.
    assert report.bytes == 5 * layer and calls[-1] == (f"export {report.name}", 5 * layer, 5 * layer)
    assert [done for _, done, _ in calls] == [layer * n for n in range(1, 6)]
    assert report.files == (
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        SAFETENSORS_INDEX,
    )
    assert report.outside_prefix == ("other", "step") and report.skipped == ()
    tensors = read_safetensors(tmp_path / "st")
    assert set(tensors) == {f"layer{i}.weight" for i in range(5)}
    assert all(same(tensors[k], state["train"]["model"][k]) for k in tensors)
    sizes = [os.path.getsize(tmp_path / "st" / f) for f in report.files[:3]]
    assert all(size < 2 * layer + 4096 for size in sizes)  # the cap, plus a header

    flat = tierstore.export(hot_dir, format="torch", out=tmp_path / "pt", strip_prefix="train.")
    loaded = torch.load(tmp_path / "pt" / TORCH_FILE, weights_only=True)
    assert set(loaded) == {f"model.layer{i}.weight" for i in range(5)} and flat.outside_prefix == (
        "other",
        "step",
    )
    with pytest.raises(ConfigError, match="no tensor of the checkpoint is under the prefix 'nope.'"):
        tierstore.export(hot_dir, format="safetensors", out=tmp_path / "none", strip_prefix="nope.")
    assert not (tmp_path / "none").exists()


# -- from the cold tier, damage ---------------------------------------------------------------


def test_export_from_the_cold_tier_alone(any_cold, tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 4, any_cold.url, migrated=True, cold_options=any_cold.options)
    shutil.rmtree(hot)  # the node is gone
    cold_only = Store(None, any_cold.url, cold_options=any_cold.options)
    tierstore.export(cold_only, format="safetensors", out=tmp_path / "st")
    tensors = read_safetensors(tmp_path / "st")
    assert all(same(tensors[k], state_for(4)[k]) for k in ("w", "b", "i"))


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_flipped_byte_fails_the_export_naming_file_checkpoint_and_tier(
    fmt: str, encoding: str, hot_dir: str, tmp_path: Path
) -> None:
    manifest = save(hot_dir, 2, options=WriterOptions(encoding=encoding)).manifest
    assert manifest is not None
    flip(file_path(hot_dir, manifest))
    parent = tmp_path / "exports"
    parent.mkdir()
    with pytest.raises(IntegrityError) as info:
        tierstore.export(hot_dir, format=fmt, out=parent / "out")
    err = info.value
    assert isinstance(err, ChecksumMismatch)
    assert (
        err.checkpoint == manifest.name and err.file == layout.data_file_name(0, 0) and "hot" in str(err.tier)
    )
    assert list(parent.iterdir()) == []  # neither out nor the work directory


def test_a_damaged_hot_copy_is_exported_from_the_cold_one(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = save(hot, 6, cold, migrated=True).manifest
    assert manifest is not None
    flip(file_path(hot, manifest))
    tierstore.export(Store(hot, cold), format="torch", out=tmp_path / "pt")
    loaded = torch.load(tmp_path / "pt" / TORCH_FILE, weights_only=True)
    assert same(loaded["w"], state_for(6)["w"])


# -- where it writes --------------------------------------------------------------------------


def test_out_is_refused_when_not_empty_or_a_url_and_force_replaces_it(hot_dir: str, tmp_path: Path) -> None:
    save(hot_dir, 1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="is not empty"):
        tierstore.export(hot_dir, format="torch", out=out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    with pytest.raises(ConfigError, match="local directory"):
        tierstore.export(hot_dir, format="torch", out="s3://bucket/model")
    with pytest.raises(ConfigError, match="not one of"):
        tierstore.export(hot_dir, format="gguf", out=tmp_path / "x")
    with pytest.raises(ConfigError, match="a dcp export keeps every key"):
        tierstore.export(hot_dir, format="dcp", out=tmp_path / "x", strip_prefix="w")
    empty = tmp_path / "empty"
    empty.mkdir()
    tierstore.export(hot_dir, format="torch", out=empty)  # an empty directory is fine
    tierstore.export(hot_dir, format="torch", out=out, force=True)
    assert [p.name for p in out.iterdir()] == [TORCH_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hot", "out"]  # nothing left aside


def test_safetensors_missing_is_a_config_error_naming_the_extra(
    hot_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(hot_dir, 1)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what an absent package raises
    with pytest.raises(ConfigError, match=r"pip install 'tierstore\[export\]'"):
        tierstore.export(hot_dir, format="safetensors", out=tmp_path / "st")
    assert not (tmp_path / "st").exists()
    tierstore.export(hot_dir, format="torch", out=tmp_path / "pt")  # the others need no extra


def test_importing_tierstore_does_not_import_safetensors() -> None:
    code = (
        "import sys, tierstore, tierstore.cli, tierstore.dcp.export; "
        "tierstore.export; assert 'safetensors' not in sys.modules, 'imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# -- a real 2-rank FSDP2 checkpoint -----------------------------------------------------------


def tensor_digest(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1).contiguous()
    return (
        f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
    )


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


@pytest.mark.dist
def test_a_two_rank_fsdp2_checkpoint_exports_the_full_state_in_every_format(tmp_path: Path) -> None:
    from launch import run_job

    hot, out = str(tmp_path / "hot"), tmp_path / "job"
    out.mkdir()
    job = run_job(
        {"op": "train_save", "hot": hot, "out": str(out), "saves": [{"step": 1, "mode": "sync"}]}, 2
    )
    assert job.ok, job.describe()
    digest = json.loads((out / "saved-1.json").read_text())
    want = {key: value for key, value in digest.items() if value.startswith("torch.")}  # its tensors
    assert len(want) > 20

    # Each rank saved half of every parameter; the export is the whole of it, in one process.
    tierstore.export(hot, format="safetensors", out=tmp_path / "st", max_shard_size=20_000, all_keys=True)
    tensors = read_safetensors(tmp_path / "st")
    assert len(list((tmp_path / "st").glob("model-*-of-*.safetensors"))) > 1
    assert {k: tensor_digest(t) for k, t in tensors.items()} == want

    # By default the model's weights, its prefix found; the same given as strip_prefix.
    for out, given in (("model", None), ("given", "model.")):
        model_only = tierstore.export(hot, format="safetensors", out=tmp_path / out, strip_prefix=given)
        tensors = read_safetensors(tmp_path / out)
        assert {f"model.{k}": tensor_digest(t) for k, t in tensors.items()} == {
            k: v for k, v in want.items() if k.startswith("model.")
        }
        assert model_only.prefix == "model."
        assert all(key.startswith("optim.") or key == "extra.step" for key in model_only.outside_prefix)

    tierstore.export(hot, format="torch", out=tmp_path / "pt")
    loaded = torch.load(tmp_path / "pt" / TORCH_FILE, weights_only=True)
    assert {k: tensor_digest(t) for k, t in flat_tensors(loaded).items()} == want
    assert loaded["extra"] == {"step": 1}

    tierstore.export(hot, format="dcp", out=tmp_path / "dcp")
    format_utils.dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")  # DCP's own reader
    full = torch.load(tmp_path / "dcp.pt", weights_only=True)
    assert {k: tensor_digest(t) for k, t in flat_tensors(full).items()} == want
    target = {k: torch.zeros_like(t) for k, t in flat_tensors(loaded["model"]).items()}
    dcp.load({"model": target}, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert all(tensor_digest(t) == want[f"model.{k}"] for k, t in target.items())
