"""``tierstore export`` in real subprocesses: each format written and read back by its own
reader, --strip-prefix, the newest checkpoint by default, a non-empty --out refused, damage
failing with nothing written, usage errors, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import blank, committed, file_path, flip, matches, save, state_for
from safetensors.torch import load_file

from tierstore import TieredWriter
from tierstore.format import layout

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


@pytest.fixture
def hot(tmp_path: Path) -> str:
    path = str(tmp_path / "hot")
    state = {"model": state_for(2), "step": 2}
    save(path, 1)
    dcp.save(state, storage_writer=TieredWriter(path, step=2), no_dist=True)
    return path


def test_safetensors_with_strip_prefix_is_the_newest_checkpoint(hot: str, tmp_path: Path) -> None:
    out = tmp_path / "st"
    proc = cli("--hot", hot, "--format", "safetensors", "--out", str(out), "--strip-prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    assert f"exported {layout.default_name(2)} (step 2) as safetensors into {out}" in proc.stdout
    assert "skipped 2 entries that are not tensors: model.extra.note, model.extra.step" in proc.stdout
    assert "left out 1 keys not under model.: step" in proc.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: "model.safetensors" for k in ("b", "i", "w")}
    tensors = load_file(out / "model.safetensors")
    want = state_for(2)
    assert all(
        torch.equal(tensors[k], want[k]) and tensors[k].dtype == want[k].dtype for k in ("w", "b", "i")
    )


def test_torch_and_dcp_by_step_and_name_with_json(hot: str, tmp_path: Path) -> None:
    proc = cli("--hot", hot, "--step", "1", "--format", "torch", "--out", str(tmp_path / "pt"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["name"], report["format"], report["files"]) == (
        layout.default_name(1),
        "torch",
        ["state_dict.pt"],
    )
    assert matches(torch.load(tmp_path / "pt" / "state_dict.pt", weights_only=True), 1)
    proc = cli(
        "--hot", hot, "--name", layout.default_name(1), "--format", "dcp", "--out", str(tmp_path / "d")
    )
    assert proc.returncode == 0, proc.stderr
    target = blank()
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "d"), no_dist=True)
    assert matches(target, 1)


def test_a_non_empty_out_is_refused_unless_force(hot: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = cli("--hot", hot, "--format", "torch", "--out", str(out))
    assert proc.returncode == 1 and "is not empty" in proc.stderr and "--force" in proc.stderr, proc.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    proc = cli("--hot", hot, "--format", "torch", "--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in out.iterdir()] == ["state_dict.pt"]


def test_damage_exits_1_naming_file_checkpoint_and_tier_and_writes_nothing(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)
    flip(file_path(hot, committed(hot, 1)))
    out = tmp_path / "out"
    proc = cli("--hot", hot, "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "ChecksumMismatch" in line and layout.default_name(1) in line
    assert layout.data_file_name(0, 0) in line and "tier 'hot" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hot"]
    proc = cli("--hot", hot, "--name", "step-0000000009", "--format", "torch", "--out", str(out))
    assert proc.returncode == 1 and "step-0000000009" in proc.stderr and not out.exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--format", "torch"], "--out"),
        (["--out", "OUT"], "--format"),
        (["--format", "gguf", "--out", "OUT"], "argument --format: invalid choice"),
        (["--format", "torch", "--out", "s3://bucket/model"], "local directory"),
        (["--format", "dcp", "--out", "OUT", "--strip-prefix", "model."], "--strip-prefix"),
        (["--format", "safetensors", "--out", "OUT", "--max-shard-size", "5XB"], "not a size"),
        (["--format", "torch", "--out", "OUT", "--step", "2", "--name", "step-0000000001"], "contradict"),
    ],
)
def test_usage_errors_exit_2(hot: str, tmp_path: Path, args: list[str], said: str) -> None:
    out = tmp_path / "out"
    proc = cli("--hot", hot, *[str(out) if a == "OUT" else a for a in args])
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not out.exists()
