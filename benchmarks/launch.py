"""Launch a multi-rank benchmark job (gloo, CPU): one subprocess per rank, like torchrun.

Rank 0 prints its progress to this process's output; other ranks' output goes to a log
kept for errors. When a rank fails, the others are stopped after a short grace period.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.servers import CREDENTIALS

ROOT = Path(__file__).resolve().parent.parent


class JobFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ, **CREDENTIALS,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TIERSTORE_EXIT_WAIT": "30",
    }


def run_ranks(spec: dict[str, Any], world: int, workdir: Path, *, timeout: float = 3600,
              grace: float = 5.0) -> list[list[dict[str, Any]]]:
    """Run ``benchmarks.rank_job`` on ``world`` ranks; return each rank's records."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(workdir)}
    spec_file = workdir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    logs: list[IO[bytes]] = []
    procs = []
    for rank in range(world):
        log: IO[bytes] | None = None
        if rank:
            log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115
            logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.rank_job", str(spec_file)], cwd=ROOT,
            env=rank_env(rank, world, port), stdout=log, stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        ))
    try:
        _wait(procs, timeout, grace)
    finally:
        for proc in procs:
            _kill_group(proc)
        for stream in logs:
            stream.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "".join(_tail(workdir / f"rank{r}.log") for r in failed if r)
        raise JobFailed(f"benchmark ranks {failed} failed (exit codes "
                        f"{[procs[r].returncode for r in failed]}){tails}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float, grace: float) -> None:
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        moment = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = moment
        if moment > deadline or (first_failure is not None and moment - first_failure > grace):
            return
        time.sleep(0.05)


def _tail(path: Path) -> str:
    try:
        return f"\n--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
