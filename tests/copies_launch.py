"""Jobs with copies on other nodes (tests/copies_job.py), as the tests of tests/redundancy run
them: "nodes" of ``LOCAL`` ranks on one host, each with a hot directory of its own under
``root/node<N>``; a save killed with SIGKILL once its copies are verified, a relaunch."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from launch import free_port, kill_group, run_job, start_rank, torchrun_env

from tierstore.format.layout import default_name

JOB = Path(__file__).resolve().with_name("copies_job.py")
LOCAL = 2  # ranks per "node"


def spec(root: Path, redundancy: list[Any], op: str, out: Path, cold: str | None = None, **more: Any) -> dict:
    """A job's spec; without ``cold``, the cold tier is an S3 URL on a closed port (down)."""
    return {
        "op": op,
        "root": str(root),
        "cold": cold or "s3://bucket/run",
        "endpoint": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "local_world": LOCAL,
        "redundancy": redundancy,
        "out": str(out),
        **more,
    }


def save_and_kill(
    tmp_path: Path,
    world: int,
    redundancy: list[Any],
    saves: list[int],
    *,
    cold: str | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    lost: tuple[int, ...] = (),
    **more: Any,
) -> dict[int, Any]:
    """Save ``saves`` with copies into ``tmp_path/nodes``, wait until every rank not in
    ``lost`` (ranks a test kills itself) has its copies verified (``ready``), then SIGKILL
    every process: the job is over, its directories as it left them. Each step's digest."""
    out = tmp_path / "saved"
    out.mkdir(exist_ok=True)
    job = spec(tmp_path / "nodes", redundancy, "save", out, cold=cold, saves=saves, hang=True, **more)
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp_path / f"save-rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        env = {**os.environ, **(rank_env or {}).get(rank, {}), **torchrun_env(rank, world, port)}
        procs.append(start_rank([sys.executable, str(JOB), json.dumps(job)], env, output=log))
    deadline = time.monotonic() + 300
    waiting = [r for r in range(world) if r not in lost]
    try:
        while not all((out / f"ready-rank{r}").exists() for r in waiting):
            ended = [r for r in waiting if procs[r].poll() is not None]
            assert not ended and time.monotonic() < deadline, logs_of(tmp_path, world, f"ranks {ended} ended")
            time.sleep(0.1)
    finally:
        for p in procs:
            kill_group(p)  # SIGKILL: nothing flushed, nothing closed
        for log in logs:
            log.close()
    return {int(k): v for k, v in json.loads((out / "saved.json").read_text()).items()}


def lose_node(root: Path, node: int) -> None:
    """Node ``node``'s disk is gone; its replacement starts on an empty directory."""
    shutil.rmtree(root / f"node{node}")
    (root / f"node{node}").mkdir()


def logs_of(tmp_path: Path, world: int, what: str) -> str:
    return (
        what
        + "\n"
        + "\n".join(
            f"--- rank {r}\n" + (tmp_path / f"save-rank{r}.log").read_text(errors="replace")[-3000:]
            for r in range(world)
        )
    )


def resume(
    root: Path, out: Path, world: int, redundancy: list[Any], *, cold: str | None = None, **more: Any
) -> list[dict]:
    """Relaunch on ``root``'s directories: every rank's load report."""
    out.mkdir(exist_ok=True)
    job = run_job(spec(root, redundancy, "resume", out, cold=cold, **more), world, timeout=300, script=JOB)
    assert job.ok, job.describe()
    return [json.loads((out / f"resumed-rank{r}.json").read_text()) for r in range(world)]


def check_resumed(saved: dict[int, Any], resumed: list[dict], lost: int, step: int | None = None) -> None:
    """Every rank resumed ``step`` (the newest saved) bit-exact (weights and AdamW moments),
    nothing read from the cold tier; the lost node's ranks got their files from the peers,
    and the checkpoint is protected again on every node."""
    step = max(saved) if step is None else step
    for rank, got in enumerate(resumed):
        assert (got["step"], got["extra"]) == (step, step), got
        assert got["digest"] == saved[step], f"rank {rank}: not bit-exact"
        sources = got["load_sources"]
        assert sources and "cold" not in sources.values(), (rank, sources)  # 0 bytes from cold
    mine = [resumed[r] for r in range(lost * LOCAL, (lost + 1) * LOCAL)]
    assert all(r["copies"]["restored_bytes"] > 0 for r in mine), mine
    assert all(r["copies"]["copies"][default_name(step)] >= 2 for r in resumed), resumed


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
