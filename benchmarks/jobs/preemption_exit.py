"""From a SIGTERM to the process's exit: ``python -m benchmarks.jobs.preemption_exit SPEC.json OUT.json``.

For each set-up of ``benchmarks/jobs/preemption_loops.py`` (the README's loop, the documented
``preempted`` loop, torchtitan, Lightning), each rep: start the job's real processes (2 gloo
ranks: ``tests/launch.py``'s, or Lightning's own launcher from one ``python train.py``), let
every rank train ``WARM_STEPS`` steps, then send SIGTERM to every rank at once, as
``srun`` signals its tasks, and watch from outside:

* **hot, cold**: from the signal to the commit of the notice's checkpoint in the hot tier and
  in the local cold tier (the push): the change time of its manifest, the commit mark, which
  the exclusive link that publishes it sets (``tierstore/storage/local.py``, ``publish``);
* **exit**: from the signal to the moment the last of the job's processes is gone, each
  one's exit code (Lightning's rank 1, a child of rank 0, is read from ``/proc`` while a
  zombie, or reaped here: this process is a child subreaper), and the seconds of the grace
  period left then.

What the manager logged itself (``PreemptionReport``'s summary: hot and cold seconds after the
signal it heard) is kept beside, as ``hot_logged``/``cold_logged``. Set-ups run in an order
that rotates by rep; the driver reports best of reps and the spread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.infra.launch import ROOT, module_main, rank_env
from benchmarks.infra.measure import Record
from tests.launch import free_port, kill_group, start_rank, torchrun_env
from tierstore.format import layout

SETUPS = ("readme", "preempted", "lightning", "torchtitan")
LAYERS = 4  # square Linear layers of the model (preemption_loops.width)
STEP_SECONDS = 0.1  # a training step, at least
WARM_STEPS = 3  # steps every rank trains before the signal
OVERRUN = 10.0  # seconds past the grace period the driver still waits, to see how late a job ends
PR_SET_CHILD_SUBREAPER = 36
# The coordinator's PreemptionReport.summary (only it commits in the cold tier).
_LOGGED = re.compile(
    r"saved step (\d+) \(\S+\) to the hot tier ([\d.]+)s after the signal, "
    r"committed in the cold tier ([\d.]+)s after the signal"
)


@dataclass
class Job:
    """The processes of one run of a set-up, and what became of each."""

    work: Path
    started: list[subprocess.Popen[bytes]]  # the processes this driver started
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid, as the ranks wrote them
    ended: dict[int, float] = field(default_factory=dict)  # rank -> time.monotonic() seen gone
    codes: dict[int, int | None] = field(default_factory=dict)  # rank -> exit code (-N: signal N)

    def step(self, rank: int) -> int:
        try:
            return int((self.work / "out" / f"step-{rank}").read_text() or 0)
        except (OSError, ValueError):
            return 0


def env_for(rank: int | None, port: int) -> dict[str, str]:
    """The ranks' environment: the benchmark's, with tierstore's defaults (no exit wait of
    our own); ``rank`` None: one ``python train.py`` whose launcher sets the ranks."""
    env = rank_env(0 if rank is None else rank, 2, port)
    env.pop("TIERSTORE_EXIT_WAIT", None)
    if rank is None:
        for name in torchrun_env(0, 2, port):
            if name not in ("MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"):
                env.pop(name, None)
    return env


def start(setup: str, spec: dict[str, Any], work: Path) -> Job:
    out = work / "out"
    out.mkdir(parents=True)
    job_spec = {
        "loop": setup,
        "out": str(out),
        "hot": str(work / "hot"),
        "cold": str(work / "cold"),
        "bytes": spec["bytes"],
        "grace": spec["grace"],
        "layers": LAYERS,
        "step_seconds": STEP_SECONDS,
    }
    (work / "spec.json").write_text(json.dumps(job_spec))
    command = [sys.executable, "-m", "benchmarks.jobs.preemption_loops", str(work / "spec.json")]
    port = free_port()
    ranks = [None] if setup == "lightning" else [0, 1]
    procs = []
    for rank in ranks:
        log = open(work / f"rank{rank or 0}.log", "wb")  # noqa: SIM115
        procs.append(start_rank(command, env_for(rank, port), cwd=ROOT, output=log))
        log.close()  # the child holds its own descriptor
    return Job(work, procs)


def wait_training(job: Job, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(job.step(r) >= steps for r in (0, 1)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.started):
            raise RuntimeError(f"the job never trained {steps} steps on both ranks\n{tails(job)}")
        time.sleep(0.05)
    for rank in (0, 1):
        job.pids[rank] = int((job.work / "out" / f"pid-{rank}").read_text())


def _proc_state(pid: int) -> tuple[str, int] | None:
    """``(state, wait status)`` of ``pid`` from ``/proc``; None once it is gone (reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[49]) if len(fields) > 49 else -1  # field 52: exit_code


def _reap(pid: int) -> int | None:
    """The exit code of ``pid`` if it is this process's child (or was handed to it as the
    subreaper) and has ended; None otherwise."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None


def watch_exits(job: Job, until: float) -> None:
    """Poll every rank until each has ended or ``until`` passes; note when and how."""
    mine = {p.pid: p for p in job.started}
    while len(job.ended) < len(job.pids) and time.monotonic() < until:
        for rank, pid in job.pids.items():
            if rank in job.ended:
                continue
            if pid in mine:
                if mine[pid].poll() is not None:
                    job.ended[rank], job.codes[rank] = time.monotonic(), mine[pid].returncode
                continue
            state = _proc_state(pid)
            if state is None or state[0] in ("Z", "X"):
                code = _reap(pid)
                if code is None and state is not None and state[1] >= 0:
                    code = os.waitstatus_to_exitcode(state[1])
                job.ended[rank], job.codes[rank] = time.monotonic(), code
        time.sleep(0.01)


def commit_times(root: Path) -> dict[str, float]:
    """Each committed checkpoint's name and the time (``time.time()``) its manifest was linked."""
    folder = root / layout.MANIFEST_DIR
    if not folder.is_dir():
        return {}
    return {p.stem: p.stat().st_ctime for p in folder.glob("*.json")}


def notice_commit(root: Path, signalled: float) -> tuple[str | None, float | None]:
    """The checkpoint committed after the signal (the newest), and seconds from it."""
    after = {name: when for name, when in commit_times(root).items() if when >= signalled - 0.01}
    if not after:
        return None, None
    name = max(after, key=after.__getitem__)
    return name, after[name] - signalled


def logged(job: Job) -> dict[str, Any]:
    """What rank 0's manager logged of the notice (PreemptionReport.summary)."""
    text = (job.work / "rank0.log").read_text(errors="replace")
    found = _LOGGED.search(text)
    if found is None:
        return {}
    step, hot, cold = found.groups()
    return {"step": int(step), "hot_logged": float(hot), "cold_logged": float(cold)}


def tails(job: Job) -> str:
    return "".join(
        f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(job.work.glob("rank*.log"))
    )


def one(setup: str, spec: dict[str, Any], work: Path, rep: int) -> Record:
    grace = spec["grace"]
    job = start(setup, spec, work)
    try:
        wait_training(job, WARM_STEPS, timeout=300)
        wall, signalled = time.time(), time.monotonic()
        for pid in job.pids.values():  # every rank at once, as srun signals its tasks
            os.kill(pid, signal.SIGTERM)
        watch_exits(job, until=signalled + grace + OVERRUN)
    finally:
        for proc in job.started:
            kill_group(proc)  # what outlived the wait (the record says so), and helpers
        for rank, pid in job.pids.items():
            if rank not in job.ended:  # an ended one's pid may be another process's by now
                _kill(pid)
        _reap_orphans()
    exited = max(job.ended.values(), default=None) if len(job.ended) == len(job.pids) else None
    name, hot = notice_commit(work / "hot", wall)
    _, cold = notice_commit(work / "cold", wall)
    record: Record = {
        "variant": setup,
        "rep": rep,
        "bytes": spec["bytes"],
        "grace": grace,
        "checkpoint": name,
        "hot": hot,
        "cold": cold,
        "exit": None if exited is None else exited - signalled,
        "left": None if exited is None else grace - (exited - signalled),
        "codes": [job.codes.get(r) for r in sorted(job.pids)],
        "exits": [job.ended[r] - signalled if r in job.ended else None for r in sorted(job.pids)],
        "still_running": sorted(set(job.pids) - set(job.ended)),
        **logged(job),
    }
    if exited is None or hot is None or cold is None:
        record["output"] = tails(job)[-6000:]
    return record


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap_orphans() -> None:
    """Reap what was handed to this subreaper (Lightning's rank 1 after rank 0 ended)."""
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not done:
            return


def become_subreaper(on: bool = True) -> None:
    """Orphans of the jobs (Lightning's rank 1, once rank 0 has ended) become this process's
    children, so their exit codes can be read here (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def describe(record: Record) -> str:
    if record.get("exit") is None:
        return f"ranks {record['still_running']} still running after the grace period and more"

    def s(value: float | None) -> str:
        return "   n/a" if value is None else f"{value:6.2f}"

    return (
        f"hot {s(record['hot'])}s  cold {s(record['cold'])}s  exit {s(record['exit'])}s  "
        f"codes {record['codes']}  left {record['left']:5.1f}s"
    )


def missing(setups: list[str]) -> dict[str, str]:
    """The set-ups whose trainer is not installed here, and what to install."""
    needs = {"lightning": "lightning", "torchtitan": "torchtitan"}
    return {
        setup: f"{needs[setup]} is not installed (`make venv` installs it)"
        for setup in setups
        if setup in needs and importlib.util.find_spec(needs[setup]) is None
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    become_subreaper()
    scratch = Path(spec["scratch"])
    setups = list(spec.get("setups", SETUPS))
    skipped = missing(setups)
    records: list[Record] = [{"variant": setup, "skipped": why} for setup, why in skipped.items()]
    for setup, why in skipped.items():
        print(f"    {setup}: not run, {why}", flush=True)
    setups = [s for s in setups if s not in skipped]
    try:
        for rep in range(spec["reps"]):
            turn = rep % len(setups)  # none always first, after the same one
            for setup in setups[turn:] + setups[:turn]:
                work = scratch / f"{setup}-{rep}"
                record = one(setup, spec, work, rep)
                records.append(record)
                print(f"    rep {rep + 1}/{spec['reps']} {setup:<11} {describe(record)}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        **{k: spec[k] for k in ("bytes", "reps", "grace")},
        "step_seconds": STEP_SECONDS,
        "warm_steps": WARM_STEPS,
        "records": records,
    }


if __name__ == "__main__":
    module_main(run)
