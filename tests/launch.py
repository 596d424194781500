"""Start real multi-process torch.distributed jobs (gloo, CPU) for tests.

Like torchrun, but small and controllable: one subprocess per rank with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set; when a rank dies the others are stopped after a short grace, so a
SIGKILLed rank never leaves its peers hanging in a collective.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = Path(__file__).with_name("dist_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


@dataclass
class JobResult:
    ranks: list[RankResult]

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)

    def describe(self) -> str:
        return "\n".join(
            f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in self.ranks
        )


def run_job(spec: dict[str, Any], world: int, *, env: dict[str, str] | None = None,
            rank_env: dict[int, dict[str, str]] | None = None, timeout: float = 180,
            grace: float = 3.0, script: Path = JOB) -> JobResult:
    """Run ``script`` with ``spec`` on ``world`` ranks; return every rank's exit and output."""
    port = free_port()
    procs = []
    for rank in range(world):
        penv = {**os.environ, **(env or {}), **((rank_env or {}).get(rank, {}))}
        penv.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    PYTHONFAULTHANDLER="1")  # a fatal signal prints every thread's stack
        procs.append(subprocess.Popen(
            [sys.executable, str(script), json.dumps(spec)], env=penv,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        ))
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = now
        if now > deadline or (first_failure is not None and now - first_failure > grace):
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
        time.sleep(0.05)
    results = []
    for rank, p in enumerate(procs):
        out = p.stdout.read().decode(errors="replace") if p.stdout else ""
        _kill_group(p)  # DCP's PROCESS-mode helpers live in the rank's process group
        results.append(RankResult(rank, p.returncode, out))
    return JobResult(results)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def leave_cleanly() -> None:
    """End a rank that finished its work: the last call of a job script, in every rank.

    Waits for every peer, collects the reference cycles FSDP2 modules sit in (they hold the
    process groups), destroys the groups, and exits without interpreter finalization: gloo
    objects still reachable then are torn down without the GIL's protection, which has
    aborted a rank (SIGABRT, "terminate called without an active exception") after all its
    results were on disk.
    """
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
