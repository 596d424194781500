"""A real 2-rank FSDP2 job (CPU, gloo) saving to and loading from a store whose only tier is
``s3://<bucket>/run``, configured through environment variables alone, bit-exact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # tests/launch.py

from launch import run_job

from tierstore import list_checkpoints

pytestmark = pytest.mark.dist

MODES = [{"step": 1, "mode": "sync"}, {"step": 2, "mode": "thread"}, {"step": 3, "mode": "process"}]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_fsdp2_save_and_load_on_s3_is_bit_exact(
    s3_env: dict[str, str], s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"s3://{s3_bucket}/run"
    out = tmp_path / "saved"
    out.mkdir()
    job = run_job({"op": "train_save", "hot": store, "out": str(out), "saves": MODES}, 2, env=s3_env)
    assert job.ok, job.describe()

    for name, value in s3_env.items():  # this process reads the store the same way
        monkeypatch.setenv(name, value)
    infos = list_checkpoints(store)
    assert [(c.step, c.world_size, c.tiers, c.num_files) for c in infos] == [
        (step, 2, ("hot",), 3) for step in (1, 2, 3)
    ]

    loads = [{"step": s, "tag": str(s)} for s in (1, 2, 3)] + [{"tag": "latest"}]
    for world in (2, 1):
        mine = tmp_path / f"loaded-at-{world}"
        mine.mkdir()
        job = run_job({"op": "load", "hot": store, "out": str(mine), "loads": loads}, world, env=s3_env)
        assert job.ok, job.describe()
        for step in (1, 2, 3):
            result = _json(mine / f"loaded-{step}.json")
            assert result["step"] == step
            assert result["digest"] == _json(out / f"saved-{step}.json"), (step, world)
        assert _json(mine / "loaded-latest.json")["digest"] == _json(out / "saved-3.json")
