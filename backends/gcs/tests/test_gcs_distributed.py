"""A real 2-rank FSDP2 job saving to, and loading from, a GCS-only store.

The only tier is ``gs://<bucket>/run``, configured through environment variables alone
(``STORAGE_EMULATOR_HOST``): the job spec holds nothing but the URL.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # tests/launch.py

from launch import run_job

from tierstore import list_checkpoints

pytestmark = pytest.mark.dist

SAVES = [{"step": 1, "mode": "sync"}, {"step": 2, "mode": "thread"}, {"step": 3, "mode": "process"}]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_fsdp2_save_and_load_bit_exact_through_gcs_only(
    gcs_bucket: str, gcs_env: dict[str, str], tmp_path: Path
) -> None:
    store = f"gs://{gcs_bucket}/run"
    saved_dir = tmp_path / "saved"
    saved_dir.mkdir()
    job = run_job({"op": "train_save", "hot": store, "out": str(saved_dir), "saves": SAVES}, 2, env=gcs_env)
    assert job.ok, job.describe()

    infos = list_checkpoints(store)
    assert [(c.step, c.world_size, c.tiers) for c in infos] == [(s, 2, ("hot",)) for s in (1, 2, 3)]
    saved = {s: _json(saved_dir / f"saved-{s}.json") for s in (1, 2, 3)}
    assert len({json.dumps(d, sort_keys=True) for d in saved.values()}) == 3  # training moved

    loads = [{"step": s, "tag": str(s)} for s in (1, 2, 3)] + [{"tag": "latest"}]
    for world in (2, 1):
        mine = tmp_path / f"loaded-{world}"
        mine.mkdir()
        job = run_job({"op": "load", "hot": store, "out": str(mine), "loads": loads}, world, env=gcs_env)
        assert job.ok, job.describe()
        for step in (1, 2, 3):
            result = _json(mine / f"loaded-{step}.json")
            assert result["step"] == step
            assert result["digest"] == saved[step], f"step {step} differs at world {world}"
        assert _json(mine / "loaded-latest.json")["digest"] == saved[3]
