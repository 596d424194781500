"""Today's on-disk format, format 1, as a store committed as written: every later change must
still list, load (bit-exact) and verify ``tests/data/store-format-1`` (issue 36).

It is one checkpoint in a hot tier, saved with the defaults of tierstore 0.1.0, the first
release (the raw encoding, a version 1 manifest with ``run``, ``metrics`` and
``fingerprint``), by running this file: ``python tests/format/test_golden_store.py <dir>``.
:func:`golden_state` is the state it saved. ``tests/data/store-0.2`` (test_format_compat.py)
is the same format 1 in the dcp encoding, from before the raw encoding existed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.scrub import verify_store

GOLDEN = Path(__file__).parents[1] / "data" / "store-format-1"
NAME, STEP, RUN = "step-0000000011", 11, "golden-run"


def golden_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(36)
    return {
        "model": {
            "w": torch.randn(6, 4, generator=g),
            "b": torch.arange(4, dtype=torch.int64),
            "h": torch.randn(5, generator=g).to(torch.bfloat16),
        },
        "step": torch.tensor(STEP),
        "extra": {"lr": 0.25, "name": "golden"},
    }


def blank_state() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.zeros(6, 4),
            "b": torch.zeros(4, dtype=torch.int64),
            "h": torch.zeros(5, dtype=torch.bfloat16),
        },
        "step": torch.tensor(0),
        "extra": {"lr": 0.0, "name": ""},
    }


def write_golden(root: str) -> None:
    """How the committed store was written (run once, with no scheduler in the environment)."""
    writer = TieredWriter(root, step=STEP, run=RUN, metrics={"val_loss": 0.5})
    dcp.save(golden_state(), storage_writer=writer, no_dist=True)


@pytest.fixture
def golden_dir(tmp_path: Path) -> str:
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return str(root)


def test_the_golden_store_is_format_1_in_todays_default_form(golden_dir: str) -> None:
    [info] = list_checkpoints(golden_dir)
    assert (info.name, info.step, info.run, info.metrics) == (NAME, STEP, RUN, {"val_loss": 0.5})
    assert info.fingerprint is not None and info.fingerprint.startswith("sha256:")
    manifest = (Path(golden_dir) / layout.manifest_key(NAME)).read_text()
    assert '"version": 1' in manifest and '"encoding": "raw"' in manifest


def test_the_golden_store_loads_bit_exact_and_verifies(golden_dir: str) -> None:
    state = blank_state()
    reader = TieredReader(golden_dir)
    dcp.load(state, storage_reader=reader)
    expected = golden_state()
    for key in ("w", "b", "h"):
        got, want = state["model"][key], expected["model"][key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert torch.equal(state["step"], expected["step"]) and state["extra"] == expected["extra"]
    assert reader.manifest is not None and reader.manifest.name == NAME
    assert all(check.ok for check in verify_store(golden_dir))


if __name__ == "__main__":
    write_golden(sys.argv[1])
