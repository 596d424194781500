"""Real 2-rank FSDP2 jobs with a cold tier: background migration under async_save, loading
from cold alone, and node-local hot tiers (one hot root per rank, as one NVMe per node)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from launch import run_job

from tierstore import list_checkpoints
from tierstore.format import layout
from tierstore.tiers.tier import Tier

pytestmark = pytest.mark.dist

ASYNC_SAVES = [{"step": s, "mode": "thread"} for s in (1, 2, 3)]


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


@pytest.fixture(params=["local", "s3"])
def cold_url_env(request, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "local":
        return str(tmp_path / "cold"), {}
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", request.getfixturevalue("s3_env")


def test_async_saves_migrate_then_load_from_cold_alone(cold_url_env, tmp_path: Path) -> None:
    cold_url, env = cold_url_env
    hot, out = str(tmp_path / "hot"), tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "train_save",
        "hot": hot,
        "cold": cold_url,
        "out": str(out),
        "saves": ASYNC_SAVES,
        "drain": True,
    }
    job = run_job(spec, 2, env=env)
    assert job.ok, job.describe()
    assert read(out, "migration.json") == {
        layout.default_name(s): {"state": "committed", "error": None} for s in (1, 2, 3)
    }
    shutil.rmtree(hot)  # the node is gone; only the object store is left
    mine = tmp_path / "loaded"
    mine.mkdir()
    job = run_job(
        {"op": "load", "hot": hot, "cold": cold_url, "out": str(mine), "loads": [{"tag": "latest"}]},
        2,
        env=env,
    )
    assert job.ok, job.describe()
    result = read(mine, "loaded-latest.json")
    assert result["step"] == 3 and result["digest"] == read(out, "saved-3.json")


def test_node_local_hot_tiers_save_and_resume_bit_exact(tmp_path: Path) -> None:
    roots = [str(tmp_path / f"node{r}" / "nvme") for r in range(2)]
    cold_url, out = str(tmp_path / "cold"), tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "train_save",
        "hot": roots,
        "cold": cold_url,
        "out": str(out),
        "saves": [{"step": 1, "mode": "thread"}, {"step": 2, "mode": "sync"}],
        "drain": True,
    }
    job = run_job(spec, 2)
    assert job.ok, job.describe()
    assert read(out, "migration.json")[layout.default_name(2)]["state"] == "committed"
    # Each node holds only its own rank's shards; only node 0 (the coordinator) has manifests.
    manifest = Tier("cold", cold_url).find_manifest(layout.default_name(2))
    for rank, root in enumerate(roots):
        present = {
            p.name for p in Path(root, layout.attempt_prefix(manifest.name, manifest.attempt)).iterdir()
        }
        assert f"__{rank}_0.distcp" in present and f"__{1 - rank}_0.distcp" not in present
    assert [c.step for c in list_checkpoints(roots[1])] == []
    mine = tmp_path / "loaded"
    mine.mkdir()
    job = run_job(
        {
            "op": "load",
            "hot": roots,
            "cold": cold_url,
            "node_local": True,
            "out": str(mine),
            "loads": [{"tag": "latest"}],
        },
        2,
    )
    assert job.ok, job.describe()
    result = read(mine, "loaded-latest.json")
    assert result["step"] == 2 and result["digest"] == read(out, "saved-2.json")
    # Each rank read its own shard from its node's hot tier and the rest from cold.
    for rank in range(2):
        sources = read(mine, f"sources-latest-rank{rank}.json")
        assert sources[f"__{rank}_0.distcp"] == "hot", sources
        assert sources.get(f"__{1 - rank}_0.distcp", "cold") == "cold", sources
    assert read(mine, "sources-latest-rank1.json")[".metadata"] == "cold"
    assert read(mine, "sources-latest-rank0.json")[".metadata"] == "hot"
