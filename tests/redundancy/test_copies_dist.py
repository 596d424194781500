"""Losing a node costs no checkpoint (issue 37): real jobs of gloo processes as nodes of two
ranks each (FSDP2 + AdamW on CPU), each node its own hot directory, the cold tier an S3 URL
on a closed port. A node's processes are SIGKILLed and its directory deleted; the relaunch,
with that node on an empty directory and the same constructor arguments, resumes bit-exact
from the surviving nodes and reads nothing from the cold tier."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launch import free_port, kill_group, run_job, start_rank, torchrun_env

from tierstore.format.layout import default_name

JOB = Path(__file__).resolve().parent.parent / "copies_job.py"
LOCAL = 2  # ranks per "node"


def _spec(tmp_path: Path, redundancy: list[Any], op: str, out: Path, **more: Any) -> dict[str, Any]:
    return {
        "op": op,
        "root": str(tmp_path / "nodes"),
        "cold": "s3://bucket/run",
        "endpoint": f"http://127.0.0.1:{free_port()}",  # nothing listens: the cold tier is down
        "local_world": LOCAL,
        "redundancy": redundancy,
        "out": str(out),
        **more,
    }


def save_then_kill(tmp_path: Path, world: int, redundancy: list[Any], victim: int, saves: list[int]) -> dict:
    """Save ``saves`` with copies, wait until every rank has its copies verified, SIGKILL the
    ``victim`` node's processes (then the rest: a job whose node died is over), delete the
    victim's directory. The state saved last, as rank 0 saw it."""
    out = tmp_path / "saved"
    out.mkdir()
    spec = _spec(tmp_path, redundancy, "save", out, saves=saves, hang=True)
    port = free_port()
    procs = []
    logs = []
    for rank in range(world):
        log = open(tmp_path / f"save-rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        env = {**__import__("os").environ, **torchrun_env(rank, world, port), "PYTHONFAULTHANDLER": "1"}
        procs.append(start_rank([sys.executable, str(JOB), json.dumps(spec)], env, output=log))
    deadline = time.monotonic() + 240
    try:
        while not all((out / f"ready-rank{r}").exists() for r in range(world)):
            failed = [r for r, p in enumerate(procs) if p.poll() is not None]
            assert not failed and time.monotonic() < deadline, _logs(tmp_path, world, f"ranks {failed} ended")
            time.sleep(0.1)
        for rank in range(victim * LOCAL, (victim + 1) * LOCAL):
            kill_group(procs[rank])  # the node is lost: SIGKILL, nothing flushed
        for p in procs:
            kill_group(p)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
        for log in logs:
            log.close()
    shutil.rmtree(tmp_path / "nodes" / f"node{victim}")  # its disk is gone
    (tmp_path / "nodes" / f"node{victim}").mkdir()  # the replacement node's empty directory
    return json.loads((out / "saved.json").read_text())


def _logs(tmp_path: Path, world: int, what: str) -> str:
    return (
        what
        + "\n"
        + "\n".join(
            f"--- rank {r}\n" + (tmp_path / f"save-rank{r}.log").read_text(errors="replace")[-3000:]
            for r in range(world)
        )
    )


def resume(tmp_path: Path, world: int, redundancy: list[Any], **more: Any) -> list[dict]:
    out = tmp_path / "resumed"
    out.mkdir(exist_ok=True)
    job = run_job(_spec(tmp_path, redundancy, "resume", out, **more), world, timeout=240, script=JOB)
    assert job.ok, job.describe()
    return [json.loads((out / f"resumed-rank{r}.json").read_text()) for r in range(world)]


def check_resumed(saved: dict, resumed: list[dict], victim: int, world: int) -> None:
    for rank, got in enumerate(resumed):
        assert (got["step"], got["extra"]) == (saved["step"], saved["step"]), got
        assert got["digest"] == saved["digest"], f"rank {rank}: not bit-exact"  # weights and AdamW moments
        sources = got["load_sources"]
        assert sources and "cold" not in sources.values(), (rank, sources)  # 0 bytes from the cold tier
    lost = [resumed[r] for r in range(victim * LOCAL, (victim + 1) * LOCAL)]
    assert all(r["copies"]["restored_bytes"] > 0 for r in lost), lost  # its files came from the peers
    kept = [resumed[r] for r in range(world) if r // LOCAL != victim]
    assert all(r["copies"]["copies"][default_name(saved["step"])] >= 2 for r in kept), kept  # re-protected


@pytest.mark.parametrize("victim", [1, 0], ids=["a-node-lost", "the-coordinators-node-lost"])
def test_replicas_a_lost_node_resumes_bit_exact_from_its_peers_with_the_cold_tier_down(
    tmp_path: Path, victim: int
) -> None:
    saved = save_then_kill(tmp_path, 4, ["replicas", 2], victim, saves=[1, 2, 3])
    assert saved["step"] == 3
    resumed = resume(tmp_path, 4, ["replicas", 2])
    check_resumed(saved, resumed, victim, 4)
    # The replaced node holds its files again: losing the other node now would cost nothing.
    node = tmp_path / "nodes" / f"node{victim}"
    assert any((node / "checkpoints").rglob("*.distcp")), "its own shards are back on its disk"
    assert any((node / "replicas" / "checkpoints").rglob("*.distcp")), (
        "and the copies it kept for the other node"
    )


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_parity_over_three_nodes_rebuilds_any_lost_node_bit_exact(tmp_path: Path, victim: int) -> None:
    # Parity(2, 1) over 3 nodes of 2 ranks: each node keeps half its data's size in parity
    # blocks, and any one node is rebuilt byte-exact from the other two.
    saved = save_then_kill(tmp_path, 6, ["parity", 2, 1], victim, saves=[1, 2])
    resumed = resume(tmp_path, 6, ["parity", 2, 1])
    check_resumed(saved, resumed, victim, 6)
    node = tmp_path / "nodes" / f"node{victim}"
    assert any((node / "checkpoints").rglob("*.distcp")), "its own shards are rebuilt on its disk"
    assert any((node / "replicas" / "checkpoints").rglob("parity/*.bin")), "and its parity blocks"
