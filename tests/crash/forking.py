"""Run storage operations in forked children that may be SIGKILLed at a chosen fault point.

The test process imports torch once; each operation forks (milliseconds, not the seconds
of a fresh interpreter) and the child runs it with fault point number ``crash_at`` (counting
every point it passes, in order) armed to SIGKILL it. Every point a child passes is traced,
so the parent learns exactly where a child died. Two-rank operations fork two children that
join a gloo group through a FileStore; when one dies the other is killed too, as a job
launcher would.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helpers import unwrap

from tierstore.storage import faults


@dataclass
class Outcome:
    """What happened to one forked operation (all its ranks)."""

    exitcodes: list[int]
    results: list[Any]  # per rank: the return value, or None
    errors: list[str | None]  # per rank: "ExcType: message" if it raised
    error_types: list[str | None]
    died_at: str | None = None  # the fault point where the armed rank was killed
    points: list[list[str]] = field(default_factory=list)  # per rank, every point passed

    @property
    def killed(self) -> bool:
        return any(code == -signal.SIGKILL for code in self.exitcodes)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exitcodes) and not any(self.errors)


def _child(
    fn: Callable[[int], Any],
    rank: int,
    world: int,
    store: str | None,
    crash_at: int | None,
    action: str,
    trace: str,
    out: str,
    env: dict[str, str],
    block: str | tuple[str, ...] | None = None,
) -> None:
    code = 0
    try:
        os.environ.update(env)
        logging.disable(logging.CRITICAL)  # expected failures would flood the test output
        faults.disarm()
        faults._trace_path = trace
        if crash_at is not None:
            faults.arm("*", action, hit=crash_at)
        for held in (block,) if isinstance(block, str) else block or ():
            faults.arm(held, "block")  # held there until the test releases it (gates.py)
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=30),
            )
        try:
            result: Any = (fn(rank), None, None)
        except BaseException as err:  # report, the parent decides what it means
            inner = unwrap(err)
            result = (None, f"{type(inner).__name__}: {inner}", type(inner).__name__)
            if os.environ.get("TIERSTORE_CRASH_DEBUG"):
                traceback.print_exc()
        with open(out + ".tmp", "wb") as f:  # a job killed mid-write leaves no torn result
            pickle.dump(result, f)
        os.replace(out + ".tmp", out)
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        os._exit(code)  # never run the parent's atexit handlers or pytest's teardown


def run(
    fn: Callable[[int], Any],
    *,
    world: int = 1,
    crash_at: int | None = None,
    victim: int = 0,
    action: str = "killgroup",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Outcome:
    """Fork ``world`` children running ``fn(rank)``; arm rank ``victim`` with ``crash_at``.

    The children form a process group of their own, so the default action kills the whole
    job at the victim's point at once: no survivor makes timing-dependent progress.
    """
    return start(fn, world=world, crash_at=crash_at, victim=victim, action=action, env=env).wait(timeout)


@dataclass
class Job:
    """Forked children still running (see :func:`start`)."""

    pids: list[int]
    scratch: str
    victim: int

    def wait(self, timeout: float = 120.0) -> Outcome:
        codes = _wait_all(self.pids, timeout)
        return _collect(self.scratch, codes, self.victim)

    def kill(self) -> None:
        """SIGKILL the whole job at once, wherever it is (a node losing power)."""
        try:
            os.killpg(self.pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(
    fn: Callable[[int], Any],
    *,
    world: int = 1,
    crash_at: int | None = None,
    victim: int = 0,
    action: str = "killgroup",
    env: dict[str, str] | None = None,
    block: str | tuple[str, ...] | None = None,
) -> Job:
    """Like :func:`run`, but return at once; rank ``victim`` may also ``block`` at a point
    (or at each of several: a gate per point, released one by one)."""
    scratch = tempfile.mkdtemp(prefix="tierstore-fork-")
    store = os.path.join(scratch, "pg-store") if world > 1 else None
    pids: list[int] = []
    for rank in range(world):
        trace, out = os.path.join(scratch, f"trace-{rank}"), os.path.join(scratch, f"out-{rank}")
        armed = crash_at if rank == victim else None
        held = block if rank == victim else None
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            os.setpgid(0, pids[0] if pids else 0)
            _child(fn, rank, world, store, armed, action, trace, out, env or {}, held)
        try:
            os.setpgid(pid, pids[0] if pids else pid)  # also from here: no race with the child
        except (PermissionError, ProcessLookupError):
            pass
        pids.append(pid)
    return Job(pids, scratch, victim)


def _collect(scratch: str, codes: list[int], victim: int) -> Outcome:
    world = len(codes)
    results, errors, types, points = [], [], [], []
    for rank in range(world):
        out, trace = os.path.join(scratch, f"out-{rank}"), os.path.join(scratch, f"trace-{rank}")
        value, error, kind = (None, None, None)
        if os.path.exists(out):
            with open(out, "rb") as f:
                value, error, kind = pickle.load(f)
        results.append(value)
        errors.append(error)
        types.append(kind)
        passed: list[str] = []
        if os.path.exists(trace):
            with open(trace) as lines:
                passed = [line.split(" ", 1)[1].strip() for line in lines]
        points.append(passed)
    died = None
    if codes[victim] == -signal.SIGKILL and points[victim]:
        died = points[victim][-1]
    _rmtree(scratch)
    return Outcome(codes, results, errors, types, died, points)


def _wait_all(pids: list[int], timeout: float) -> list[int]:
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    first_death: float | None = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and first_death is None:
                    first_death = time.monotonic()
        now = time.monotonic()
        if now > deadline or (first_death is not None and now - first_death > 1.0):
            for pid in pids:  # the job dies with its rank, as under torchrun
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    return [codes[pid] for pid in pids]


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
