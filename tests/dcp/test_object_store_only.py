"""A real 2-rank FSDP2 job (CPU, gloo) saving to and loading from a store whose only tier is
an object store, ``s3://<bucket>/run`` on moto or ``gs://<bucket>/run`` on fake-gcs-server,
configured through environment variables alone (the job spec holds nothing but the URL):
each step bit-exact at world sizes 2 and 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import run_job

from tierstore import list_checkpoints

pytestmark = pytest.mark.dist

SAVES = [{"step": 1, "mode": "sync"}, {"step": 2, "mode": "thread"}, {"step": 3, "mode": "process"}]
# What each store needs: its plugin, and the fixtures naming its bucket and environment.
STORES = {"s3": ("tierstore_s3", "s3_bucket", "s3_env"), "gcs": ("tierstore_gcs", "gcs_bucket", "gcs_env")}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", sorted(STORES))
def test_fsdp2_save_and_load_through_an_object_store_alone_is_bit_exact(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin, bucket_fixture, env_fixture = STORES[kind]
    pytest.importorskip(plugin, reason="the object-store plugins are installed by make test")
    bucket, env = request.getfixturevalue(bucket_fixture), request.getfixturevalue(env_fixture)
    store = f"{'gs' if kind == 'gcs' else 's3'}://{bucket}/run"
    out = tmp_path / "saved"
    out.mkdir()
    job = run_job({"op": "train_save", "hot": store, "out": str(out), "saves": SAVES}, 2, env=env)
    assert job.ok, job.describe()

    for name, value in env.items():  # this process reads the store the same way
        monkeypatch.setenv(name, value)
    infos = list_checkpoints(store)
    assert [(c.step, c.world_size, c.tiers, c.num_files) for c in infos] == [
        (step, 2, ("hot",), 3) for step in (1, 2, 3)
    ]
    saved = {step: _json(out / f"saved-{step}.json") for step in (1, 2, 3)}
    assert len({json.dumps(d, sort_keys=True) for d in saved.values()}) == 3  # training moved

    loads = [{"step": s, "tag": str(s)} for s in (1, 2, 3)] + [{"tag": "latest"}]
    for world in (2, 1):
        mine = tmp_path / f"loaded-at-{world}"
        mine.mkdir()
        job = run_job({"op": "load", "hot": store, "out": str(mine), "loads": loads}, world, env=env)
        assert job.ok, job.describe()
        for step in (1, 2, 3):
            result = _json(mine / f"loaded-{step}.json")
            assert result["step"] == step
            assert result["digest"] == saved[step], f"step {step} differs at world {world}"
        assert _json(mine / "loaded-latest.json")["digest"] == saved[3]
