"""``tierstore.export`` for the Hugging Face tools (issue 38 item 2): a ``CheckpointManager`` +
``TrainingState`` checkpoint exported as it is loads with ``from_pretrained`` (a GPT-2 built from
a ``GPT2Config``: the model's weights only, its prefix found, the tied ``lm_head.weight`` left
out, a ``config.json`` copied in, a dtype cast), and the export's directory and files get the
modes the umask gives."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tierstore
from tierstore import CheckpointManager, ConfigError, TrainingState
from tierstore.dcp.export import SAFETENSORS_INDEX, TORCH_FILE

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: every model is built from a config
import transformers  # the `test` extra installs it; it reads HF_HUB_OFFLINE when imported

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class TinyLM(torch.nn.Module):
    """An embedding tied to the output head (as GPT-2's ``wte``/``lm_head``) and two LayerNorms
    whose weights start equal (ones): equal bytes alone do not make a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.ln_a = torch.nn.LayerNorm(8)
        self.ln_b = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_b(self.ln_a(self.embed(ids))))


def train_and_save(
    hot: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, steps: int
) -> None:
    """``steps`` training steps, each saved by a ``CheckpointManager`` as ``{"train": state}``."""
    torch.manual_seed(1)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(hot, save_every=1)
    try:
        for step in range(1, steps + 1):
            if optimizer is not None:
                ids = torch.randint(0, 16, (4, 6))
                logits = model(ids)
                logits = getattr(logits, "logits", logits)
                logits.float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            state.step = step
            manager.save(step, {"train": state})
    finally:
        manager.close()


def read_export(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / file))
    assert set(tensors) == set(index["weight_map"])
    return tensors


# -- the model's prefix ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "prefix"),
    [
        # CheckpointManager + TrainingState: the model beside the optimizer, the RNG, ...
        (["train.model.w", "train.optim.state.w.exp_avg", "train.rng.rank0.torch"], "train.model."),
        # a Hugging Face model whose own first module is `model` (Llama), inside a training state
        (
            [
                "train.model.model.embed.weight",
                "train.model.lm_head.weight",
                "train.optim.state.model.embed.weight.exp_avg",
            ],
            "train.model.",
        ),
        # DCP's examples: {"model": ..., "optim": ...}
        (["model.layer.weight", "optim.state.layer.weight.exp_avg"], "model."),
        # the state dict of such a model saved alone: `model.` is a module beside `lm_head`
        (["model.embed.weight", "lm_head.weight"], None),
        # nothing names a model
        (["w", "b", "extra.step"], None),
    ],
)
def test_the_model_prefix_is_found_from_the_keys(keys: list[str], prefix: str | None) -> None:
    from tierstore.dcp._model_keys import model_prefix

    assert model_prefix(keys) == prefix


def test_two_models_are_ambiguous_and_the_error_says_what_to_give() -> None:
    from tierstore.dcp._model_keys import model_prefix

    with pytest.raises(
        ConfigError, match=r"more than one model \(student\.model\., teacher\.model\.\)"
    ) as info:
        model_prefix(["student.model.w", "teacher.model.w", "student.optim.state.w.exp_avg"])
    assert "--strip-prefix" in str(info.value) and "--all" in str(info.value)


# -- a TrainingState checkpoint, exported as it is ---------------------------------------------------


def test_a_training_state_checkpoint_exports_the_model_once_by_default(hot_dir: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    train_and_save(hot_dir, model, torch.optim.Adam(model.parameters(), lr=1e-2), steps=2)
    report = tierstore.export(hot_dir, out=tmp_path / "out")
    assert report.prefix == "train.model." and report.step == 2
    assert report.tied == (("head.weight", "embed.weight"),)
    tensors = read_export(tmp_path / "out")
    live = model.state_dict()
    assert set(tensors) == set(live) - {"head.weight"}  # no optimizer moment, no RNG, the tie once
    assert all(torch.equal(tensors[k], live[k]) for k in tensors)
    assert report.keys == len(tensors) and report.skipped == ()
    assert {k.split(".")[1] for k in report.outside_prefix} == {"optim", "rng", "step"}

    # Everything, when asked; a prefix given is stripped as given (and its ties found too).
    every = tierstore.export(hot_dir, out=tmp_path / "all", all_keys=True)
    assert every.prefix is None and every.tied == ()
    assert any(".exp_avg" in key for key in read_export(tmp_path / "all"))
    given = tierstore.export(hot_dir, out=tmp_path / "given", strip_prefix="train.model.")
    assert given.tied == report.tied and set(read_export(tmp_path / "given")) == set(tensors)
    with pytest.raises(ConfigError, match="all_keys is for format safetensors without strip_prefix"):
        tierstore.export(hot_dir, out=tmp_path / "x", all_keys=True, strip_prefix="train.")


def test_equal_weights_are_not_a_tie_without_the_optimizer_saying_so(hot_dir: str, tmp_path: Path) -> None:
    # No optimizer: nothing says head.weight and embed.weight were one; both are written.
    torch.manual_seed(0)
    model = TinyLM()
    train_and_save(hot_dir, model, None, steps=1)
    report = tierstore.export(hot_dir, out=tmp_path / "alone")
    assert report.prefix == "train.model." and report.tied == ()
    assert set(read_export(tmp_path / "alone")) == set(model.state_dict())

    # An optimizer that holds state for both LayerNorms (lr 0: their weights stay equal, ones):
    # equal bytes with state on both sides are two parameters, not a tie.
    hot = str(tmp_path / "hot2")
    model = TinyLM()
    train_and_save(hot, model, torch.optim.Adam(model.parameters(), lr=0.0), steps=1)
    assert torch.equal(model.ln_a.weight, model.ln_b.weight)
    report = tierstore.export(hot, out=tmp_path / "still")
    assert report.tied == (("head.weight", "embed.weight"),)
    assert {"ln_a.weight", "ln_b.weight", "ln_a.bias", "ln_b.bias"} <= set(read_export(tmp_path / "still"))


def test_dtype_casts_floating_tensors_only_and_config_is_copied_checked(hot_dir: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    model.register_buffer("count", torch.arange(4))  # an integer tensor: never cast
    train_and_save(hot_dir, model, torch.optim.Adam(model.parameters(), lr=1e-2), steps=1)
    config = tmp_path / "my-config.json"
    config.write_text('{"model_type": "tiny",  "hidden": 8}\n')
    report = tierstore.export(hot_dir, out=tmp_path / "bf16", dtype="bfloat16", config=config)
    assert report.dtype == "bfloat16" and "config.json" in report.files
    assert (tmp_path / "bf16" / "config.json").read_bytes() == config.read_bytes()  # as the user wrote it
    tensors = read_export(tmp_path / "bf16")
    assert tensors["count"].dtype == torch.int64 and torch.equal(tensors["count"], torch.arange(4))
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))
    index = json.loads((tmp_path / "bf16" / SAFETENSORS_INDEX).read_text())
    assert (
        index["metadata"]["total_size"]
        == report.bytes
        == sum(t.numel() * t.element_size() for t in tensors.values())
    )

    tierstore.export(
        hot_dir, out=tmp_path / "pt", format="torch", dtype="float16", strip_prefix="train.model."
    )
    loaded = torch.load(tmp_path / "pt" / TORCH_FILE, weights_only=True)
    assert loaded["ln_a.weight"].dtype == torch.float16 and loaded["count"].dtype == torch.int64

    for text, said in (
        ("[1, 2]", "holds a JSON list"),
        ("{model_type: gpt2}", "is not a readable JSON file"),
    ):
        config.write_text(text)
        with pytest.raises(ConfigError, match=said):
            tierstore.export(hot_dir, out=tmp_path / "bad", config=config)
    with pytest.raises(ConfigError, match="is not a readable JSON file"):
        tierstore.export(hot_dir, out=tmp_path / "bad", config=tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="config is for format safetensors"):
        tierstore.export(hot_dir, out=tmp_path / "bad", format="torch", config=config)
    with pytest.raises(ConfigError, match="dtype 'int8'"):
        tierstore.export(hot_dir, out=tmp_path / "bad", dtype="int8")
    with pytest.raises(ConfigError, match="dtype 'float16'"):
        tierstore.export(hot_dir, out=tmp_path / "bad", format="dcp", dtype="float16")
    assert not (tmp_path / "bad").exists()


# -- modes ---------------------------------------------------------------------------------------


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(out: Path) -> tuple[int, set[int]]:
    return stat.S_IMODE(out.stat().st_mode), {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_the_export_gets_the_modes_the_umask_gives(
    fmt: str, hot_dir: str, tmp_path: Path, umask: None
) -> None:
    torch.manual_seed(0)
    train_and_save(hot_dir, TinyLM(), None, steps=1)
    tierstore.export(hot_dir, out=tmp_path / "shared", format=fmt)
    assert modes(tmp_path / "shared") == (0o755, {0o644})  # drwxr-xr-x, -rw-r--r--
    os.umask(0o027)
    tierstore.export(hot_dir, out=tmp_path / "group", format=fmt)
    assert modes(tmp_path / "group") == (0o750, {0o640})
    os.umask(0o022)
    (tmp_path / "forced").mkdir(mode=0o700)
    (tmp_path / "forced" / "old.txt").write_text("x")
    tierstore.export(hot_dir, out=tmp_path / "forced", format=fmt, force=True)  # replaced whole
    assert modes(tmp_path / "forced") == (0o755, {0o644})


# -- from_pretrained ---------------------------------------------------------------------------------


def tiny_gpt2() -> tuple[object, object]:
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return config, transformers.GPT2LMHeadModel(config)


def load_strict(out: Path, **kwargs: object) -> torch.nn.Module:
    """``from_pretrained(out)``, asserting no key missing, unexpected or mismatched (the tied
    ``lm_head.weight`` is tied again, not missing)."""
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model


def test_a_gpt2_trained_under_the_manager_loads_with_from_pretrained_as_exported(
    hot_dir: str, tmp_path: Path
) -> None:
    config, model = tiny_gpt2()
    train_and_save(hot_dir, model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps=2)
    config.save_pretrained(tmp_path / "base")
    report = tierstore.export(hot_dir, out=tmp_path / "gpt2", config=tmp_path / "base" / "config.json")
    assert report.prefix == "train.model." and report.tied == (("lm_head.weight", "transformer.wte.weight"),)
    assert sorted(report.files) == sorted(["model.safetensors", SAFETENSORS_INDEX, "config.json"])

    loaded = load_strict(tmp_path / "gpt2")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    live = model.state_dict()
    assert all(torch.equal(value, live[key]) for key, value in loaded.state_dict().items())
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    tierstore.export(
        hot_dir, out=tmp_path / "bf16", config=tmp_path / "base" / "config.json", dtype="bfloat16"
    )
    half = load_strict(tmp_path / "bf16", dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.transformer.wte.weight, model.transformer.wte.weight.detach().to(torch.bfloat16))
