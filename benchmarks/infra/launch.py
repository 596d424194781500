"""Run benchmark jobs in processes of their own, on the launcher the tests use
(``tests/launch.py``): a multi-rank job (gloo, CPU) or a one-process job module.

Rank 0 prints its progress to this process's output; other ranks' output goes to a log
kept for errors. When a rank fails, the others are stopped after a short grace period.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from benchmarks.infra.servers import CREDENTIALS
from tests.launch import free_port, kill_group, start_rank, torchrun_env, wait_ranks

ROOT = Path(__file__).resolve().parents[2]


class JobFailed(RuntimeError):
    pass


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        **CREDENTIALS,
        **torchrun_env(rank, world, port),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TIERSTORE_EXIT_WAIT": "30",
    }


def run_ranks(
    spec: dict[str, Any], world: int, workdir: Path, *, timeout: float = 3600, grace: float = 5.0
) -> list[list[dict[str, Any]]]:
    """Run ``benchmarks.jobs.rank_job`` on ``world`` ranks; return each rank's records."""
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
        procs.append(
            start_rank(
                [sys.executable, "-m", "benchmarks.jobs.rank_job", str(spec_file)],
                rank_env(rank, world, port),
                cwd=ROOT,
                output=log,
            )
        )
    try:
        wait_ranks(procs, timeout, grace)
    finally:
        for proc in procs:
            kill_group(proc)
        for stream in logs:
            stream.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "".join(_tail(workdir / f"rank{r}.log") for r in failed if r)
        raise JobFailed(
            f"benchmark ranks {failed} failed (exit codes {[procs[r].returncode for r in failed]}){tails}"
        )
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


def run_module(name: str, spec: dict[str, Any], work: Path, timeout: float = 3600) -> Any:
    """Run ``python -m benchmarks.jobs.<name> SPEC OUT`` in its own process; return OUT."""
    work.mkdir(parents=True)
    (work / "spec.json").write_text(json.dumps(spec))
    subprocess.run(
        [sys.executable, "-m", f"benchmarks.jobs.{name}", str(work / "spec.json"), str(work / "out.json")],
        cwd=ROOT,
        env=rank_env(0, 1, 0),
        check=True,
        timeout=timeout,
    )
    return json.loads((work / "out.json").read_text())


def module_main(run: Callable[[dict[str, Any]], Any]) -> None:
    """The job module's end of :func:`run_module`: ``run(SPEC)`` written to OUT as JSON."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


def _tail(path: Path) -> str:
    try:
        return f"\n--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""
