"""``tierstore export`` for the Hugging Face tools (issue 38 item 2), in real subprocesses under
umask 022: a ``CheckpointManager`` + ``TrainingState`` GPT-2 checkpoint exported with
``--config`` loads with ``from_pretrained`` as it is; the output names the prefix it found and
the tied weight it left out; ``--all``, ``--dtype``; the new options' usage errors; modes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore import CheckpointManager, TrainingState

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built from a config
import transformers  # the `test` extra installs it; it reads HF_HUB_OFFLINE when imported

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: os.umask(0o022),  # a shell's usual umask
    )


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, transformers.GPT2LMHeadModel]:
    """A tiny GPT-2 trained 2 steps, each saved by a CheckpointManager as {"train": state};
    its config.json; the live model."""
    tmp = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainingState(model, optimizer)
    hot = str(tmp / "hot")
    manager = CheckpointManager(hot, save_every=1)
    try:
        for step in (1, 2):
            ids = torch.randint(0, 64, (2, 8))
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state.step = step
            manager.save(step, {"train": state})
    finally:
        manager.close()
    config.save_pretrained(tmp / "base")
    return hot, tmp / "base" / "config.json", model.eval()


def test_the_default_export_with_config_loads_with_from_pretrained(gpt2, tmp_path: Path) -> None:
    hot, config, model = gpt2
    out = tmp_path / "gpt2"
    proc = cli("--hot", hot, "--format", "safetensors", "--out", str(out), "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    said = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"  # whole, should CI ever differ again
    assert "exported the model's weights, under train.model. (found from the keys" in proc.stdout, said
    assert "left out lm_head.weight: tied to transformer.wte.weight" in proc.stdout
    assert "keys not under train.model.: train.optim." in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}

    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_all_dtype_and_json(gpt2, tmp_path: Path) -> None:
    hot, config, model = gpt2
    proc = cli("--hot", hot, "--format", "safetensors", "--out", str(tmp_path / "all"), "--all", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["prefix"] is None and report["tied"] == [] and report["outside_prefix"] == []
    index = json.loads((tmp_path / "all" / "model.safetensors.index.json").read_text())
    assert "train.model.lm_head.weight" in index["weight_map"]
    assert any(key.startswith("train.optim.state.") for key in index["weight_map"])

    out = tmp_path / "half"
    proc = cli(
        "--hot",
        hot,
        "--format",
        "safetensors",
        "--out",
        str(out),
        "--dtype",
        "float16",
        "--config",
        str(config),
    )
    assert proc.returncode == 0, proc.stderr
    assert "cast floating tensors to float16" in proc.stdout
    half = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float16)
    assert torch.equal(half.transformer.wte.weight, model.transformer.wte.weight.detach().half())


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--format", "safetensors", "--all", "--strip-prefix", "train.model."], "not allowed with argument"),
        (["--format", "torch", "--all"], "--all is for --format safetensors"),
        (["--format", "torch", "--config", "CONFIG"], "--config is for --format safetensors"),
        (["--format", "dcp", "--dtype", "bfloat16"], "--dtype is for --format safetensors or torch"),
        (["--format", "safetensors", "--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--format", "safetensors", "--config", "NOTJSON"], "is not a readable JSON file"),
        (["--format", "safetensors", "--config", "MISSING"], "is not a readable JSON file"),
    ],
)
def test_usage_errors_of_the_new_options_exit_2(gpt2, tmp_path: Path, args: list[str], said: str) -> None:
    hot, config, _ = gpt2
    (tmp_path / "bad.json").write_text("{not json")
    where = {
        "CONFIG": str(config),
        "NOTJSON": str(tmp_path / "bad.json"),
        "MISSING": str(tmp_path / "no.json"),
    }
    out = tmp_path / "out"
    proc = cli("--hot", hot, "--out", str(out), *[where.get(a, a) for a in args])
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not out.exists()
