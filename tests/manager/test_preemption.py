"""Preemption (tierstore.manager.preemption): a signal, then a grace period before SIGKILL.

The save after the signal saves that step, whatever the cadence says, to the hot tier and,
within the grace period, to the cold tier, and the loop stops there; the handler only
records, calls the one installed before it, and is put back by close(). In this process
(the signal sent to itself) against every kind of cold tier, and in a subprocess sent the
signal from outside, which must exit 0 and resume at the step it stopped at. The 2-rank
jobs are in tests/manager/test_preemption_dist.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cold_tiers import Cold

from tierstore import CheckpointManager, PreemptionOptions, Retention, Store, TieredReader, list_checkpoints
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.migration.migrator import MigrationOptions
from tierstore.storage import faults

FAST = MigrationOptions(poll_interval=0.05)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step, "step": step}


def loads_from_cold_alone(cold: Cold, step: int) -> bool:
    target = {"w": torch.zeros(4096), "step": -1}
    reader = TieredReader(Store(cold=cold.url, cold_options=cold.direct_options), step=step)
    dcp.load(target, storage_reader=reader)
    return torch.equal(target["w"], state(step)["w"]) and target["step"] == step


def cold_steps(cold: Cold) -> list[int | None]:
    return [c.step for c in list_checkpoints(Store(cold=cold.url, cold_options=cold.direct_options))]


@pytest.fixture
def previous_handler() -> Iterator[list[int]]:
    """A Python SIGTERM handler of the test's own, as a user's would be; put back after."""
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda number, frame: calls.append(number))
    yield calls
    signal.signal(signal.SIGTERM, before)


def test_the_save_after_a_signal_saves_that_step_in_both_tiers_and_the_loop_stops(
    any_cold: Cold, tmp_path: Path, previous_handler: list[int]
) -> None:
    hot = str(tmp_path / "hot")
    manager = CheckpointManager(
        Store(hot, any_cold.url, cold_options=any_cold.options), save_every=100, migration=FAST
    )
    stopped = None
    for step in range(1, 50):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # between two cadence saves (there are none)
        if manager.save(step, state(step)) and manager.preempted:
            stopped = step
            break
    assert stopped == 7  # the first save() after the signal
    report = manager.preemption
    assert report is not None and report.signal == "SIGTERM" and report.checkpoint == layout.default_name(7)
    assert report.cold == "committed", report  # a healthy cold tier, slow or not, has it now
    assert 0 < report.hot_seconds <= report.cold_seconds <= 30 and report.seconds_left > 0
    assert previous_handler == [signal.SIGTERM]  # chained, once
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is not manager._notice.watch.signals._handle  # type: ignore[union-attr]
    os.kill(os.getpid(), signal.SIGTERM)  # the handler before the manager's is back
    assert previous_handler == [signal.SIGTERM, signal.SIGTERM]
    assert [c.step for c in list_checkpoints(hot)] == [7]
    assert cold_steps(any_cold) == [7] and loads_from_cold_alone(any_cold, 7)


def test_one_notice_one_emergency_save_and_saves_go_on_as_the_cadence_says(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    with CheckpointManager(hot, save_every=4) as manager:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is the same request
        assert manager.save(1, state(1)) and manager.preempted
        assert manager.save(2, state(2)) is False  # a loop that goes on: the cadence again
        assert manager.save(4, state(4))
        manager.wait()
    assert [c.step for c in list_checkpoints(hot)] == [1, 4]


def test_a_save_in_flight_completes_before_the_emergency_save(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    block = tmp_path / "block"
    block.mkdir()
    os.environ[faults.BLOCK_DIR_ENV] = str(block)
    faults.arm("writer.after_file_write", "block")
    try:
        manager = CheckpointManager(hot, save_every=5, retention=Retention(hot_min_free=None))
        assert manager.save(5, state(5))  # async: its flush is held at the fault point
        deadline = time.monotonic() + 30
        while not list(block.glob("writer.after_file_write.*.reached")):
            assert time.monotonic() < deadline, "the async save never reached its file write"
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        (block / "writer.after_file_write.release").touch()  # the in-flight flush may finish
        assert manager.save(6, state(6)) and manager.preempted
    finally:
        faults.disarm()
        os.environ.pop(faults.BLOCK_DIR_ENV)
    manager.close()
    assert [c.step for c in list_checkpoints(hot)] == [5, 6]
    assert manager.health().saves_ok == 2 and manager.health().saves_failed == 0


@pytest.mark.parametrize("any_cold", ["s3-slow"], indirect=True)
def test_with_the_cold_tier_down_the_push_and_close_keep_to_the_grace_period(
    any_cold: Cold, tmp_path: Path
) -> None:
    cold = any_cold
    hot = str(tmp_path / "hot")
    grace = 4.0
    manager = CheckpointManager(
        Store(hot, cold.url, cold_options=cold.options),
        save_every=100,
        preemption=PreemptionOptions(grace_seconds=grace),
    )
    cold.down("stall")  # every request hangs: the slowest way for a cold tier to fail
    os.kill(os.getpid(), signal.SIGTERM)
    signalled = time.monotonic()
    assert manager.save(3, state(3)) and manager.preempted
    report = manager.preemption
    assert report is not None and report.checkpoint == layout.default_name(3)
    assert report.cold.startswith("still "), report  # not committed, and says so
    with pytest.raises(Exception, match="did not reach the cold tier"):
        manager.close()
    assert time.monotonic() - signalled < grace  # the push and close() left the exit its margin
    assert [c.step for c in list_checkpoints(hot)] == [3]  # committed and pending in hot
    cold.up()


def test_a_save_whose_staging_process_the_signal_killed_is_abandoned_and_that_step_saved(
    tmp_path: Path,
) -> None:
    # A scheduler signals every process of the job: DCP's PROCESS-mode helper, flushing the
    # save of step 2, dies of it; that save fails (logged), and step 3 is saved in-process.
    script = textwrap.dedent("""
        import os, signal, sys, time, torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
        dist.init_process_group("gloo", rank=0, world_size=1)
        from tierstore import CheckpointManager, StagingOptions
        hot, cold = sys.argv[1] + "/hot", sys.argv[1] + "/cold"
        manager = CheckpointManager(hot, cold, save_every=2, staging=StagingOptions(mode="process"))
        state = {"w": torch.randn(1 << 20)}
        block = sys.argv[1] + "/block"
        os.makedirs(block)
        # Armed in the helper process alone (armed as it starts; this process started unarmed):
        # its flush of step 2 holds at its file write until the signal has killed it.
        from tierstore.testing.faults import armed_env
        os.environ.update(armed_env("writer.after_file_write=block", block_dir=block))
        for step in range(1, 50):
            if manager.save(step, state) and manager.preempted:
                print("stopped", step, manager.preemption.cold, flush=True)
                break
            if step == 2:
                while not any(n.endswith(".reached") for n in os.listdir(block)):
                    time.sleep(0.01)
                os.killpg(os.getpgid(0), signal.SIGTERM)
        manager.close()
    """)
    from launch import free_port

    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(free_port())],
        capture_output=True,
        timeout=240,
        start_new_session=True,  # its own process group, signalled whole
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert done.stdout.decode().split() == ["stopped", "3", "committed"], err
    assert "the save before the preemption notice failed" in err  # step 2's, abandoned
    assert [c.step for c in list_checkpoints(Store(str(tmp_path / "hot"), str(tmp_path / "cold")))] == [3]


def test_preemption_off_leaves_the_signal_to_its_default(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from tierstore import CheckpointManager
        manager = CheckpointManager(sys.argv[1], save_every=100, preemption=False)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        manager.save(1, {"w": torch.zeros(4)})
        print("survived")
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "hot")], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGTERM, done.stderr.decode()
    assert b"survived" not in done.stdout


def test_a_released_handler_still_called_by_one_installed_after_it_takes_the_default_action(
    tmp_path: Path,
) -> None:
    # Lightning, for one, installs its SIGTERM handler after the manager's and calls it.
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from tierstore import CheckpointManager
        manager = CheckpointManager(sys.argv[1], save_every=100)
        ours = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda n, f: (print("wrapper", flush=True), ours(n, f)))
        manager.close()
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "hot")], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGTERM, done.stderr.decode()
    assert done.stdout == b"wrapper\n"


@pytest.mark.parametrize(
    "value, message",
    [
        ("yes", "takes True, False or a PreemptionOptions, got str"),
        (30, "takes True, False or a PreemptionOptions, got int"),
    ],
)
def test_a_preemption_argument_is_checked_when_built(tmp_path: Path, value: object, message: str) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError, match=message):
        CheckpointManager(str(tmp_path / "hot"), preemption=value)  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) == before  # refused before any handler went in


LOOP = textwrap.dedent("""
    import json, sys, time, torch
    from tierstore import CheckpointManager, PreemptionOptions
    spec = json.loads(sys.argv[1])
    manager = CheckpointManager(
        spec["hot"], spec["cold"], save_every=spec["save_every"],
        preemption=PreemptionOptions(grace_seconds=spec["grace"]),
    )
    state = {"w": torch.zeros(65536), "step": 0}
    start = manager.load_latest(state) or 0
    print(json.dumps({"resumed": start, "w0": float(state["w"][0])}), flush=True)
    for step in range(start + 1, start + 100000):
        state["w"] += 1.0  # "training": after step s the weights are s everywhere
        state["step"] = step
        print(json.dumps({"step": step}), flush=True)
        time.sleep(0.02)
        if manager.save(step, state) and manager.preempted:
            report = manager.preemption
            print(json.dumps({"stopped": step, "cold": report.cold, "left": report.seconds_left}), flush=True)
            break
    manager.close()
""")


def run_until_signalled(spec: dict[str, Any], at_step: int) -> tuple[int, list[dict[str, Any]]]:
    """Run LOOP, SIGTERM it once it reports ``at_step``; its exit code and its lines."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    lines = []
    try:
        for raw in proc.stdout:
            line = json.loads(raw)
            lines.append(line)
            if line.get("step") == at_step:
                proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.stderr is not None
    lines.append({"stderr": proc.stderr.read().decode()})
    return proc.returncode, lines


def test_a_job_signalled_from_outside_exits_0_and_resumes_at_that_step(tmp_path: Path) -> None:
    spec = {"hot": str(tmp_path / "hot"), "cold": str(tmp_path / "cold"), "save_every": 50, "grace": 10}
    code, lines = run_until_signalled(spec, at_step=13)
    assert code == 0, lines[-1]
    stopped = next(line for line in lines if "stopped" in line)
    assert 13 <= stopped["stopped"] <= 14 and stopped["cold"] == "committed"  # the next save() after it
    assert "preempted (SIGTERM): saved step" in lines[-1]["stderr"]
    code, lines = run_until_signalled(spec, at_step=stopped["stopped"] + 2)  # relaunched, preempted again
    assert code == 0, lines[-1]
    resumed = lines[0]
    assert resumed == {
        "resumed": stopped["stopped"],
        "w0": float(stopped["stopped"]),
    }  # no step lost or replayed
    assert lines[1] == {"step": stopped["stopped"] + 1}
    again = next(line for line in lines if "stopped" in line)["stopped"]
    assert [c.step for c in list_checkpoints(Store(cold=spec["cold"]))] == [stopped["stopped"], again]
