"""A store written by tierstore 0.2 (commit 554632a, before the raw encoding) still loads,
verified, with the code of today: ``tests/data/store-0.2`` is that store, committed as written.

It was made with ``dcp.save(state, storage_writer=TieredWriter(root, step=3))`` from that
commit; :func:`golden_state` rebuilds the state it saved.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import flip

from tierstore import TieredReader, TieredWriter, list_checkpoints
from tierstore.errors import ChecksumMismatch
from tierstore.lifecycle.scrub import verify_store

GOLDEN = Path(__file__).parents[1] / "data" / "store-0.2"


def golden_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(8, 5, generator=g),
        "b": torch.arange(6, dtype=torch.int64),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3),
        "extra": {"lr": 0.1, "name": "golden"},
    }


def blank_state() -> dict[str, Any]:
    return {
        "w": torch.zeros(8, 5),
        "b": torch.zeros(6, dtype=torch.int64),
        "h": torch.zeros(3, dtype=torch.bfloat16),
        "step": torch.tensor(0),
        "extra": {"lr": 0.0, "name": ""},
    }


@pytest.fixture
def golden_dir(tmp_path: Path) -> str:
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return str(root)


def test_a_0_2_store_lists_loads_and_verifies(golden_dir: str) -> None:
    [info] = list_checkpoints(golden_dir)
    assert (info.name, info.step, info.num_files) == ("step-0000000003", 3, 2)
    state = blank_state()
    reader = TieredReader(golden_dir)
    dcp.load(state, storage_reader=reader)
    expected = golden_state()
    for key in ("w", "b", "h", "step"):
        assert torch.equal(state[key], expected[key]), key
    assert state["extra"] == expected["extra"]
    assert reader.manifest is not None and reader.manifest.encoding == "dcp"
    assert all(check.ok for check in verify_store(golden_dir))


def test_a_0_2_store_still_catches_a_flipped_byte(golden_dir: str) -> None:
    [data] = Path(golden_dir).glob("checkpoints/*/*/__0_0.distcp")
    flip(data)
    with pytest.raises(BaseException) as caught:
        dcp.load(blank_state(), storage_reader=TieredReader(golden_dir))
    assert "CRC32C mismatch" in str(caught.value) or isinstance(caught.value, ChecksumMismatch)


def test_new_saves_beside_a_0_2_checkpoint_use_the_raw_encoding(golden_dir: str) -> None:
    dcp.save(golden_state(), storage_writer=TieredWriter(golden_dir, step=4))
    assert [c.step for c in list_checkpoints(golden_dir)] == [3, 4]
    for step in (3, 4):
        state = blank_state()
        reader = TieredReader(golden_dir, step=step)
        dcp.load(state, storage_reader=reader)
        assert torch.equal(state["w"], golden_state()["w"]), step
        assert reader.manifest is not None
        assert reader.manifest.encoding == ("dcp" if step == 3 else "raw")
