"""CheckpointManager driving a real 2-rank FSDP2 training loop (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import run_job

from tierstore import Store, list_checkpoints

pytestmark = pytest.mark.dist


def test_manager_saves_every_5_keeps_policy_sets_and_resumes(tmp_path: Path) -> None:
    hot, cold, out = str(tmp_path / "hot"), str(tmp_path / "cold"), tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager",
        "hot": hot,
        "cold": cold,
        "out": str(out),
        "steps": 20,
        "save_every": 5,
        "hot_policy": "last:2",
        "cold_policy": "last:2|every:10",
    }
    job = run_job(spec, 2)
    assert job.ok, job.describe()
    assert sorted(int(s) for s in json.loads((out / "stalls.json").read_text())) == [5, 10, 15, 20]
    assert [c.step for c in list_checkpoints(hot)] == [15, 20]  # keep_last(2)
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [10, 15, 20]  # last 2 | every 10
    # Nothing else is left behind in either tier: pruned data is gone, marks cleaned up.
    for root, keep in ((hot, {15, 20}), (cold, {10, 15, 20})):
        dirs = {p.name for p in Path(root, "checkpoints").iterdir()}
        assert dirs == {f"step-{s:010d}" for s in keep}, (root, dirs)
    job = run_job({"op": "manager_load", "hot": hot, "cold": cold, "out": str(out)}, 2)
    assert job.ok, job.describe()
    loaded = json.loads((out / "loaded-manager.json").read_text())
    assert loaded["step"] == 20 and loaded["extra_step"] == 20
    assert loaded["digest"] == json.loads((out / "saved-20.json").read_text())
