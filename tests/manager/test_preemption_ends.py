"""SIGTERM always ends the process (issue 35, items 1-3; docs/training-state.md, "What
happens to the process"): real processes, signalled from outside.

* the README's loop, which never reads ``manager.preempted``: the notice's step is saved to
  both tiers at the next ``save()``, and the process ends at the one after it (the signal's
  default action), one rank signalled or every rank, once or twice;
* a process that never reaches another ``save()`` (stuck) ends at the grace deadline;
* a torchrun agent's SIGTERM to a worker whose peer failed ends it within the grace period,
  not after the agent's own 30 s;
* a signal after the last save, during ``close()``: close keeps to the grace period from
  then on, and the process ends;
* managers opened and closed in any order: a closed one in the handler chain never takes the
  default action for the run's manager;
* a loop that reads ``preempted`` and goes on keeps its retention, and its ``close()`` says
  only what is true.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cold_tiers import Cold
from launch import JOB, free_port, kill_group
from test_preemption_dist import cold_spec, describe, progress, run_preempted

from tierstore import CheckpointManager, PreemptionOptions, Retention, Store, keep_last, list_checkpoints
from tierstore.format import layout

pytestmark = pytest.mark.slow

GRACE = 8.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def steps_in(cold: Cold) -> list[int]:
    return [c.step for c in list_checkpoints(Store(cold=cold.url, cold_options=cold.direct_options))]


# -- the README's loop, 2 gloo ranks -----------------------------------------------------------


@pytest.mark.parametrize(
    "signal_ranks", [(0,), (1,), (0, 1), (0, 0)], ids=["rank-0", "rank-1", "every-rank", "rank-0-twice"]
)
def test_the_readme_loop_saves_that_step_and_every_rank_ends(
    tmp_path: Path, signal_ranks: tuple[int, ...]
) -> None:
    """It trained on after the notice's save (60 steps in 30 s, until SIGKILLed)."""
    cold = Cold("local", str(tmp_path / "cold"), {}, {})
    out, again = tmp_path / "out", tmp_path / "again"
    out.mkdir()
    again.mkdir()
    spec = {
        "op": "manager_preempt",
        "hot": str(tmp_path / "hot"),
        **cold_spec(cold),
        "out": str(out),
        "save_every": 1000,
        "grace": GRACE,
        "reads_preempted": False,
    }
    results, signalled = run_preempted(spec, signal_ranks=signal_ranks, at_step=4)
    took = time.monotonic() - signalled
    context = describe(results)
    assert [code for code, _ in results] == [-signal.SIGTERM] * 2, context  # ended, as the signal ends it
    assert took < GRACE, context
    saved = json.loads((out / "saved.json").read_text())
    assert saved["step"] >= 4, context
    assert saved["step"] in [c.step for c in list_checkpoints(str(tmp_path / "hot"))], context
    assert saved["step"] in steps_in(cold), context  # pushed within the grace period
    # The relaunch resumes that step bit-exact.
    relaunch = {**spec, "out": str(again), "reads_preempted": True}
    results, _ = run_preempted(relaunch, signal_ranks=(0,), at_step=saved["step"] + 1)
    assert [code for code, _ in results] == [0, 0], describe(results)
    resumed = json.loads((again / "resumed-rank0.json").read_text())
    assert (resumed["step"], resumed["digest"]) == (saved["step"], saved["digest"])


def test_a_torchrun_worker_whose_peer_failed_ends_within_the_grace_period(tmp_path: Path) -> None:
    """torchrun's agent ends the workers left after a failure with SIGTERM, then SIGKILL 30 s
    later: a worker that ignores the SIGTERM (busy in a validation pass, never reaching
    another save()) delayed every restart by those 30 s."""
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager_preempt",
        "hot": str(tmp_path / "hot"),
        "cold": None,
        "out": str(out),
        "save_every": 1000,
        "grace": GRACE,
        "fail_rank": 1,
        "fail_at": 4,
        "busy_seconds": 45,  # rank 0 in a long validation pass when the agent's SIGTERM comes
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
        f"--master-port={free_port()}", str(JOB), json.dumps(spec),
    ]  # fmt: skip
    agent = subprocess.Popen(
        command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while progress(out, 1) < 3:
            assert agent.poll() is None and time.monotonic() < deadline, agent.stdout.read().decode()  # type: ignore[union-attr]
            time.sleep(0.01)
        failed = time.monotonic()  # rank 1 raises at its next step
        agent.wait(60)
        took = time.monotonic() - failed
    finally:
        kill_group(agent)  # type: ignore[arg-type]
    output = agent.stdout.read().decode(errors="replace")  # type: ignore[union-attr]
    assert agent.returncode != 0, output  # a worker failed: the agent says so
    assert took < GRACE + 5, f"{took:.1f}s from the failure to the agent's exit\n{output[-4000:]}"


# -- one process, from outside ------------------------------------------------------------------

SCRIPT = """
import json, os, sys, time, torch
from tierstore import CheckpointManager, PreemptionOptions, Retention, Store, keep_last
from tierstore.options import ManagerOptions
spec = json.loads(sys.argv[1])
def state(step): return {"w": torch.arange(4096, dtype=torch.float32) * step}
"""


def run_script(
    body: str, spec: dict[str, Any], tmp_path: Path, *, signal_when: str, timeout: float = 120
) -> tuple[int, str, float]:
    """Run ``SCRIPT + body``; once ``signal_when`` exists under tmp_path, SIGTERM it. Its exit
    code, output, and the seconds from the signal to its end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT + textwrap.dedent(body), json.dumps(spec)],
        env={**ENV, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not (tmp_path / signal_when).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace")  # type: ignore[union-attr]
                pytest.fail(f"never got to {signal_when}: exit {proc.returncode}\n{out[-4000:]}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(timeout)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, proc.stdout.read().decode(errors="replace"), took  # type: ignore[union-attr]


README_LOOP = """
manager = CheckpointManager(
    Store(spec["hot"], spec["cold"], cold_options=spec["cold_options"]), save_every=10,
    retention=Retention(hot=keep_last(2), cold=keep_last(3), hot_min_free=None),
    preemption=PreemptionOptions(grace_seconds=spec["grace"]),
)
for step in range(1, 100_000):
    time.sleep(0.02)  # training
    manager.save(step, state(step))
    if step == 25:
        open(spec["ready"], "w").close()
manager.close()
"""


def test_a_single_process_readme_loop_ends_with_that_step_saved_and_retention_kept(
    any_cold: Cold, tmp_path: Path
) -> None:
    """It trained on to step 399 with retention off: 398 hot checkpoints against keep_last(2)."""
    hot = str(tmp_path / "hot")
    spec = {"hot": hot, **cold_spec(any_cold), "grace": GRACE, "ready": str(tmp_path / "ready")}
    code, out, took = run_script(README_LOOP, spec, tmp_path, signal_when="ready")
    assert code == -signal.SIGTERM and took < GRACE, out[-4000:]
    hot_steps = [c.step for c in list_checkpoints(hot)]
    last = max(s for s in hot_steps if s is not None)
    assert last % 10 != 0 or last > 25, hot_steps  # the notice's step, off the cadence
    assert len(hot_steps) <= 3, hot_steps  # keep_last(2) and the notice's: retention held
    assert last in steps_in(any_cold), out[-4000:]
    assert "unreachable" not in out and "did not reach the cold tier" not in out, out[-4000:]


STUCK = """
manager = CheckpointManager(spec["hot"], preemption=PreemptionOptions(grace_seconds=spec["grace"]))
manager.save(1, state(1), force=True)
manager.wait()
open(spec["ready"], "w").close()
time.sleep(3600)  # a rank that never gets to another save(): stuck in a collective, say
"""


def test_a_process_that_never_reaches_another_save_ends_at_the_grace_deadline(tmp_path: Path) -> None:
    spec = {"hot": str(tmp_path / "hot"), "grace": 4.0, "ready": str(tmp_path / "ready")}
    code, out, took = run_script(STUCK, spec, tmp_path, signal_when="ready")
    assert code == -signal.SIGTERM, out[-4000:]
    assert 4.0 * 0.8 < took < 4.0, f"{took:.2f}s\n{out[-4000:]}"  # at the deadline, before a SIGKILL
    assert "neither stopped on `manager.preempted` nor reached another save()" in out


CLOSING = """
manager = CheckpointManager(
    Store(spec["hot"], spec["cold"], cold_options=spec["cold_options"]),
    options=ManagerOptions(close_timeout=60),
    retention=Retention(hot_min_free=None), preemption=PreemptionOptions(grace_seconds=spec["grace"]),
)
manager.save(1, state(1), force=True)
manager.wait(migrations=False)
open(spec["ready"], "w").close()  # the cold tier is down: close() waits for it
started = time.monotonic()
try:
    manager.close()
finally:
    print("close() returned after", time.monotonic() - started, flush=True)
"""


def test_a_signal_during_close_bounds_it_by_the_grace_period(switchable_cold: Cold, tmp_path: Path) -> None:
    """close() ran to close_timeout (300 s by default against a 30 s grace period): the job
    was SIGKILLed inside it."""
    switchable_cold.down("refuse" if switchable_cold.kind == "local" else "stall")
    spec = {
        "hot": str(tmp_path / "hot"),
        **cold_spec(switchable_cold),
        "grace": 5.0,
        "ready": str(tmp_path / "ready"),
    }
    code, out, took = run_script(CLOSING, spec, tmp_path, signal_when="ready")
    assert took < 5.0, f"{took:.2f}s after the signal\n{out[-4000:]}"
    assert code == -signal.SIGTERM, out[-4000:]
    assert [c.step for c in list_checkpoints(str(tmp_path / "hot"))] == [1]  # pending, in hot


CHAIN = """
pretrained = CheckpointManager(spec["other"], preemption=PreemptionOptions(grace_seconds=spec["grace"]))
manager = CheckpointManager(spec["hot"], save_every=1000, preemption=PreemptionOptions(grace_seconds=spec["grace"]))
pretrained.close()  # the one that loaded the weights: built first, closed first
open(spec["ready"], "w").close()
for step in range(1, 100_000):
    time.sleep(0.02)
    if manager.save(step, state(step)) and manager.preempted:
        print("stopped at", step, flush=True)
        break
manager.close()
"""


def test_a_manager_closed_before_the_signal_never_takes_the_default_action_for_the_run(
    tmp_path: Path,
) -> None:
    """The run's handler chained to the closed one, which took the default action: exit -15
    at once, no checkpoint."""
    spec = {
        "hot": str(tmp_path / "hot"),
        "other": str(tmp_path / "other"),
        "grace": GRACE,
        "ready": str(tmp_path / "ready"),
    }
    code, out, took = run_script(CHAIN, spec, tmp_path, signal_when="ready")
    assert code == 0 and "stopped at" in out, out[-4000:]
    step = int(out.split("stopped at", 1)[1].split()[0])
    assert [c.step for c in list_checkpoints(str(tmp_path / "hot"))] == [step]


# -- a loop that takes over and goes on --------------------------------------------------------


def test_a_loop_that_reads_preempted_and_goes_on_keeps_its_retention(tmp_path: Path) -> None:
    """After the notice's grace period a loop that went on prunes again, and its close()
    neither calls a healthy cold tier unreachable nor names a checkpoint it delivered."""
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manager = CheckpointManager(
        hot,
        cold,
        save_every=1,
        retention=Retention(hot=keep_last(2), cold=keep_last(3), hot_min_free=None),
        preemption=PreemptionOptions(grace_seconds=1.0),
    )
    for step in range(1, 40):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        if manager.save(step, {"w": torch.full((64,), float(step))}) and manager.preempted:
            pass  # read: the loop decides, and it goes on (the notice was a drill)
        time.sleep(0.05)
    assert manager.preemption is not None and manager.preemption.step == 5
    started = time.monotonic()
    manager.close()  # raises MigrationFailed if it names anything
    assert time.monotonic() - started < 30
    assert len(list_checkpoints(hot)) <= 3
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [37, 38, 39]
    assert layout.default_name(39) in {c.name for c in list_checkpoints(hot)}
