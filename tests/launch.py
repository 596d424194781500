"""Start real multi-process torch.distributed jobs (gloo, CPU): the one launcher of the
tests and the benchmarks (``benchmarks/infra/launch.py`` builds its jobs on it).

Like torchrun, but small and controllable: one subprocess per rank with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set, each in its own session; when a rank dies the others are stopped
after a short grace, so a SIGKILLed rank never leaves its peers hanging in a collective.
Standard library only: the benchmarks import it, and it must import nothing they add.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

JOB = Path(__file__).with_name("dist_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for one rank on one host, plus unbuffered output and one OpenMP
    thread (ranks share a few cores)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


def start_rank(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: Path | None = None,
    output: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start one rank in a session of its own, so that :func:`kill_group` also ends the
    helper processes it starts (DCP's PROCESS-mode stagers). ``output`` takes its stdout
    and stderr together; ``None`` leaves both to this process's. A Python script starts
    from a process that imported torch already (tests/preload.py: the same real process,
    started in a fraction of the CPU), anything else with ``subprocess.Popen``."""
    rank = _preloaded(command, env, cwd, output)
    if rank is not None:
        return rank  # type: ignore[return-value]  # Popen's interface, as far as the tests use it
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        start_new_session=True,
    )


def _preloaded(
    command: Sequence[str], env: Mapping[str, str], cwd: Path | None, output: IO[bytes] | int | None
) -> Any:
    """tests/preload.py's rank, where the tests turned it on (``TIERSTORE_TEST_PRELOAD=1``,
    tests/conftest.py); the benchmarks start every rank as a user's job does."""
    if os.environ.get("TIERSTORE_TEST_PRELOAD") != "1":
        return None
    module = sys.modules.get("tierstore_test_preload")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "tierstore_test_preload", Path(__file__).with_name("preload.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["tierstore_test_preload"] = module
        spec.loader.exec_module(module)
    return module.preloaded(command, env, cwd, output)


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], timeout: float, grace: float) -> None:
    """Return once every rank exited, at ``timeout``, or ``grace`` seconds after the first
    rank failed (its peers may be blocked in a collective that will never complete).
    Ranks still running then are the caller's to stop (:func:`kill_group`)."""
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        moment = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = moment
        if moment > deadline or (first_failure is not None and moment - first_failure > grace):
            return
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a rank's whole session, the rank itself if still running, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


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
        return "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-4000:]}" for r in self.ranks)


def run_job(
    spec: dict[str, Any],
    world: int,
    *,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    timeout: float = 180,
    grace: float = 3.0,
    script: Path = JOB,
) -> JobResult:
    """Run ``script`` with ``spec`` on ``world`` ranks; return every rank's exit and output."""
    port = free_port()
    procs = []
    for rank in range(world):
        penv = {
            **os.environ,
            **(env or {}),
            **((rank_env or {}).get(rank, {})),
            **torchrun_env(rank, world, port),
            "PYTHONFAULTHANDLER": "1",
        }  # a fatal signal prints every thread's stack
        procs.append(
            start_rank([sys.executable, str(script), json.dumps(spec)], penv, output=subprocess.PIPE)
        )
    wait_ranks(procs, timeout, grace)
    for p in procs:
        if p.poll() is None:
            kill_group(p)  # past the deadline or the grace: its output so far is all we get
    results = []
    for rank, p in enumerate(procs):
        out = p.stdout.read().decode(errors="replace") if p.stdout else ""
        kill_group(p)  # DCP's PROCESS-mode helpers live in the rank's process group
        results.append(RankResult(rank, p.returncode, out))
    return JobResult(results)


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
