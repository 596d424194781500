"""Node-local hot tiers with the cold tier down, in real 2-rank jobs (issue 22, item 5): every
rank gets the same error from a resume (none hangs), ``close(T)`` takes about T, and the
checkpoints a run left pending are finished by the next run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.dist
def test_a_node_local_resume_with_the_cold_tier_down_fails_alike_on_every_rank(tmp_path: Path) -> None:
    import socket

    from launch import run_job

    with socket.socket() as sock:  # a port nothing listens on: the cold tier is down
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager_cold_down",
        "hot": [str(tmp_path / f"node{r}") for r in (0, 1)],
        "cold": "s3://bucket/run",
        "endpoint": f"http://127.0.0.1:{port}",
        "out": str(out),
        "close_timeout": 10,
    }
    job = run_job(spec, 2, timeout=150)
    assert job.ok, job.describe()
    results = [json.loads((out / f"cold-down-rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["load"] for r in results} == {"TransientStorageError"}, results  # none hung
    for r in results:
        assert r["close"] == "MigrationFailed", results
        assert r["close_seconds"] < 10 + 10, results  # the deadline, not one per wait


@pytest.mark.dist
def test_a_node_local_runs_pending_checkpoints_are_finished_by_the_next_run(tmp_path: Path) -> None:
    from launch import run_job

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cold tier's directory should be")
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager_node_local_resume",
        "hot": [str(tmp_path / f"node{r}") for r in (0, 1)],
        "blocker": str(blocker),
        "out": str(out),
    }
    job = run_job(spec, 2, timeout=150)
    assert job.ok, job.describe()
    results = [json.loads((out / f"node-local-resume-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["first"] == "MigrationFailed" for r in results), results
    assert all(r["cold"] == [1, 2] for r in results), results
