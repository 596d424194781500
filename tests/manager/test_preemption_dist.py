"""Preemption in a real 2-rank gloo job (FSDP2 on CPU): SIGTERM at a random step between
cadence saves, with a 10 s grace period, on one rank or both, or while an async save is in
flight. The checkpoint of the step the ranks stop at commits in the hot tier and, the cold
tier being healthy, in the cold tier before the processes exit 0; the relaunch resumes at
that step bit-exact (no step lost, none replayed)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cold_tiers import Cold
from launch import JOB, free_port, kill_group, start_rank, torchrun_env, wait_ranks

from tierstore import Store, list_checkpoints
from tierstore.testing.faults import armed_env

pytestmark = pytest.mark.slow

GRACE = 10.0


def start_job(spec: dict[str, Any], world: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    return [
        start_rank(
            [sys.executable, str(JOB), json.dumps(spec)],
            {**os.environ, **env, **torchrun_env(rank, world, port), "PYTHONFAULTHANDLER": "1"},
            output=subprocess.PIPE,
        )
        for rank in range(world)
    ]


def finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[tuple[int, str]]:
    wait_ranks(procs, timeout, grace=5.0)
    results = []
    for p in procs:
        if p.poll() is None:
            kill_group(p)
        out = p.stdout.read().decode(errors="replace") if p.stdout else ""
        kill_group(p)
        results.append((p.returncode, out))
    return results


def progress(out: Path, rank: int) -> int:
    try:
        return int((out / f"progress-rank{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def run_preempted(
    spec: dict[str, Any], *, signal_ranks: tuple[int, ...], at_step: int, env: dict[str, str] | None = None
) -> tuple[list[tuple[int, str]], float]:
    """Start the job, SIGTERM ``signal_ranks`` once rank 0 reached ``at_step``; the ranks'
    exits and outputs, and when the signal went."""
    out = Path(spec["out"])
    procs = start_job(spec, 2, env or {})
    deadline = time.monotonic() + 120
    try:
        while progress(out, 0) < at_step:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return finish(procs, 0), 0.0
            time.sleep(0.01)
        for rank in signal_ranks:
            procs[rank].send_signal(signal.SIGTERM)  # the rank only, as a scheduler signals tasks
        signalled = time.monotonic()
        return finish(procs, GRACE + 20), signalled
    except BaseException:
        for p in procs:
            kill_group(p)
        raise


def cold_spec(cold: Cold) -> dict[str, Any]:
    options = {k: v for k, v in cold.options.items() if k != "retry"}  # the default policy
    return {"cold": cold.url, "cold_options": options or None}


def describe(results: list[tuple[int, str]]) -> str:
    return "\n".join(f"--- rank {r} exit {code}\n{out[-3000:]}" for r, (code, out) in enumerate(results))


def check_preempted_and_resumed(
    tmp_path: Path,
    cold: Cold,
    signal_ranks: tuple[int, ...],
    *,
    save_every: int,
    at_step: int | None = None,
    env: dict[str, str] | None = None,
    node_local: bool = False,
) -> dict[str, Any]:
    at_step = at_step or random.Random().randint(3, 8)
    out, again = tmp_path / "out", tmp_path / "again"
    out.mkdir()
    again.mkdir()
    hot: str | list[str] = (
        [str(tmp_path / f"node{r}" / "nvme") for r in (0, 1)] if node_local else str(tmp_path / "hot")
    )
    spec = {
        "op": "manager_preempt",
        "hot": hot,
        "node_local": node_local,
        **cold_spec(cold),
        "out": str(out),
        "save_every": save_every,
        "grace": GRACE,
    }
    results, signalled = run_preempted(spec, signal_ranks=signal_ranks, at_step=at_step, env=env)
    exited = time.monotonic()
    context = f"signalled rank(s) {signal_ranks} at step {at_step}\n{describe(results)}"
    assert [code for code, _ in results] == [0, 0], context  # the default action was not taken
    assert exited - signalled < GRACE, context  # out within the grace period
    saved = json.loads((out / "preempted.json").read_text())
    reports = [json.loads((out / f"preempted-rank{r}.json").read_text()) for r in (0, 1)]
    stopped = saved["step"]
    assert at_step <= stopped <= at_step + 2, context  # the next save() after the signal
    assert [r["step"] for r in reports] == [stopped, stopped], context  # every rank, one step
    assert [r["signal"] is not None for r in reports] == [r in signal_ranks for r in (0, 1)], context
    assert reports[0]["cold"] == "committed", context  # the coordinator committed it in cold
    if not node_local:  # a node-local hot tier is no catalog: the cold manifest commits
        assert stopped in [c.step for c in list_checkpoints(str(tmp_path / "hot"))], context
    in_cold = list_checkpoints(Store(cold=cold.url, cold_options=cold.direct_options))
    assert stopped in [c.step for c in in_cold], context
    # The relaunch resumes at that step, bit-exact, then trains on from the next one.
    relaunch = {**spec, "out": str(again)}
    results, _ = run_preempted(relaunch, signal_ranks=(0, 1), at_step=stopped + 1)
    assert [code for code, _ in results] == [0, 0], describe(results)
    for rank in (0, 1):
        resumed = json.loads((again / f"resumed-rank{rank}.json").read_text())
        assert (resumed["step"], resumed["extra"]) == (stopped, stopped)
        assert resumed["digest"] == saved["digest"]  # bit-exact: model and optimizer
    assert json.loads((again / "preempted.json").read_text())["step"] == stopped + 1
    return {"stopped": stopped, "digest": saved["digest"], "out": out}


@pytest.mark.parametrize("signal_ranks", [(1,), (0, 1)], ids=["one-rank", "every-rank"])
def test_a_sigterm_between_cadence_saves_saves_that_step_and_the_relaunch_resumes_it(
    tmp_path: Path, signal_ranks: tuple[int, ...]
) -> None:
    cold = Cold("local", str(tmp_path / "cold"), {}, {})
    check_preempted_and_resumed(tmp_path, cold, signal_ranks, save_every=1000)


@pytest.mark.parametrize("any_cold", ["s3-slow"], indirect=True)
def test_a_sigterm_on_rank_0_with_a_slow_s3_cold_tier(tmp_path: Path, any_cold: Cold) -> None:
    check_preempted_and_resumed(tmp_path, any_cold, (0,), save_every=1000)


def test_a_sigterm_while_an_async_save_is_in_flight(tmp_path: Path) -> None:
    # Every save's flush sleeps 1.5 s at its file write, and a save comes every 2 steps: the
    # signal, sent as rank 0 reaches an odd step, lands while the previous step's save is in
    # flight; that save completes, then the step the signal found is saved.
    cold = Cold("local", str(tmp_path / "cold"), {}, {})
    sleeps = ";".join(f"writer.after_file_write@{hit}=sleep" for hit in range(1, 9))
    env = armed_env(sleeps, sleep=1.5)
    at_step = random.Random().choice([3, 5, 7])
    result = check_preempted_and_resumed(tmp_path, cold, (0,), save_every=2, at_step=at_step, env=env)
    steps = [c.step for c in list_checkpoints(str(tmp_path / "hot"))]
    assert result["stopped"] in steps and len(steps) >= 2, steps  # the cadence's and the notice's


def test_a_sigterm_with_node_local_hot_tiers_commits_that_step_in_cold(tmp_path: Path) -> None:
    # Each node's hot root holds its rank's shards only: the checkpoint exists once the
    # coordinator commits it in cold, within the grace period; the relaunch resumes it.
    cold = Cold("local", str(tmp_path / "cold"), {}, {})
    check_preempted_and_resumed(tmp_path, cold, (1,), save_every=1000, node_local=True)
