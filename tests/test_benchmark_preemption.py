"""The Preemption section's signal-to-exit part (benchmarks/jobs/preemption_exit.py and its
table in benchmarks/report/preemption.py): one row per training loop in a fixed order, each
rank's exit code, and a job that ran past its grace period or never committed said in bold,
never hidden in a best-of. The job's two ways of seeing from outside are checked on their
own: a commit's time is when its manifest was linked, and a rank that is not this process's
child (Lightning's rank 1) is seen ending with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.jobs import preemption_exit
from benchmarks.report import preemption, render
from tierstore.format import layout
from tierstore.storage import faults
from tierstore.storage.local import LocalBackend

SMOKE = Path(__file__).parent / "data" / "bench-smoke.json"


def _record(loop: str, rep: int, **fields: Any) -> dict[str, Any]:
    base = {"variant": loop, "rep": rep, "grace": 30.0, "hot": 0.4, "cold": 0.6, "exit": 2.0, "left": 28.0}
    return {**base, "codes": [0, 0], **fields}


def _exit(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "bytes": 64 << 20,
        "reps": 2,
        "grace": 30.0,
        "step_seconds": 0.1,
        "warm_steps": 3,
        "records": records,
    }


def _exit_part(suite: dict[str, Any]) -> list[str]:
    return preemption.exit_part({"suites": {"preemption": {"exit": suite}}}).splitlines()


def _rows(lines: list[str]) -> list[list[str]]:
    table = [line for line in lines if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in table[1:]]


def test_one_row_per_loop_in_order_with_exit_codes_best_of_reps_and_the_least_time_left() -> None:
    records = [
        _record("torchtitan", 0),
        _record("readme", 0, codes=[-15, -15], exit=1.0, left=29.0),
        _record("readme", 1, codes=[-15, -15], hot=0.8, exit=1.5, left=28.5),
        _record("preempted", 0),
        _record("lightning", 0, codes=[0, None]),  # rank 1 reaped by rank 0 before it was seen
        _record("lightning", 1),
    ]
    rows = _rows(_exit_part(_exit(records)))
    assert [row[0] for row in rows] == [name for name, _ in preemption.LOOPS.values()]
    assert list(preemption.LOOPS) == ["readme", "preempted", "lightning", "torchtitan"]
    readme = rows[0]
    assert readme[2] == "-15 (SIGTERM) / -15 (SIGTERM)"
    assert readme[3] == "0.400 (spread 2.00x)" and readme[5] == "1.000 (spread 1.50x)"
    assert readme[6] == "28.5 (95%)"
    assert rows[2][2] == "0 / ? (1 of 2); 0 / 0 (1 of 2)"


def test_a_job_past_its_grace_period_or_without_a_commit_is_said_in_bold() -> None:
    records = [
        _record("preempted", 0, exit=None, left=None, cold=None),
        _record("preempted", 1),
    ]
    (row,) = _rows(_exit_part(_exit(records)))
    assert row[4] == "0.600 (spread 1.00x), **none in 1 of 2 reps**"
    assert row[6] == "**none: 1 of 2 reps ran past the grace period**"


def test_a_loop_whose_trainer_is_not_installed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "torchtitan" else real(name)
    )
    assert preemption_exit.missing(["readme", "lightning", "torchtitan"]) == {
        "torchtitan": "torchtitan is not installed (`make venv` installs it)"
    }
    records = [{"variant": "torchtitan", "skipped": "torchtitan is not installed"}, _record("readme", 0)]
    rows = _rows(_exit_part(_exit(records)))
    assert [row[1] for row in rows][1] == "not run: torchtitan is not installed" and rows[1][2:] == ["-"] * 5


def test_the_exit_table_is_a_part_of_its_own_and_an_older_results_file_leaves_it(tmp_path: Path) -> None:
    results = json.loads(SMOKE.read_text())
    results["suites"] = {"preemption": results["suites"]["preemption"]}
    results["suites"]["preemption"]["exit"] = _exit([_record(loop, 0) for loop in preemption.LOOPS])
    doc = tmp_path / "benchmarks.md"
    assert render.write(results, doc) == ["preemption", "preemption.exit"]
    assert len(_rows(render.parts(doc.read_text())["preemption.exit"].splitlines())) == 4
    del results["suites"]["preemption"]["exit"]  # an older results file: the first table alone
    assert render.write(results, doc) == ["preemption"]


def test_a_commit_is_timed_by_the_link_that_publishes_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(faults.SLEEP_ENV, "0.3")
    faults.arm("local.publish.after_temp_fsync", "sleep")  # written, then linked 0.3 s later
    try:
        started = time.time()
        LocalBackend(str(tmp_path)).publish(layout.manifest_key("step-7"), b"{}")
    finally:
        faults.disarm()
    name, seconds = preemption_exit.notice_commit(tmp_path, started)
    assert name == "step-7" and seconds is not None and 0.28 <= seconds < 2
    assert preemption_exit.notice_commit(tmp_path, time.time() + 1) == (None, None)


def test_a_rank_started_by_another_rank_is_seen_ending_with_its_exit_code(tmp_path: Path) -> None:
    """As Lightning's launcher starts rank 1: the driver only knows its pid."""
    spawn = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3); raise SystemExit(3)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"  # never reaps it: a zombie until this one ends
    )
    preemption_exit.become_subreaper()
    try:
        for parent_lives in (5.0, 0.0):  # the child ends a zombie of its parent, or an orphan of ours
            parent = subprocess.Popen(
                [sys.executable, "-c", spawn, str(parent_lives)], stdout=subprocess.PIPE
            )
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            job = preemption_exit.Job(tmp_path, [parent], pids={1: child})
            preemption_exit.watch_exits(job, until=time.monotonic() + 10)
            assert job.codes == {1: 3}
            parent.kill()
            parent.wait()
    finally:
        preemption_exit.become_subreaper(False)  # this test process goes back to what it was
