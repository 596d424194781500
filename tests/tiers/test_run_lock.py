"""Two jobs, one hot directory (issue 16 item 8): real training processes, real SIGKILL.

The second job to start warns once, naming both jobs and the directory; the first learns of
it at its next heartbeat. A killed job's lock stops counting once it expires by the store's
clock (or at once when its pid is visibly gone), and a clean close releases the lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore import _dist
from tierstore.format import layout
from tierstore.tiers import runlock
from tierstore.tiers.leases import store_time
from tierstore.tiers.tier import Tier

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import logging, sys, warnings
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    import torch
    from tierstore import CheckpointManager, Retention, StagingOptions, keep_last
    hot, first = sys.argv[1], int(sys.argv[2])
    manager = CheckpointManager(
        hot, staging=StagingOptions(async_save=False), retention=Retention(hot=keep_last(10))
    )
    for step in range(first, first + 3):  # saves after the start do not warn again
        manager.save(step, {"w": torch.full((4,), float(step))}, force=True)
    print("READY", flush=True)
    if sys.stdin.readline().strip() == "close":
        manager.close()
        print("CLOSED", flush=True)
""")

STARTING = "another job is saving into the hot directory"
LATER = "started saving into the hot directory"


class Job:
    def __init__(self, tmp: Path, hot: Path, first: int, *, ttl: float, prefix: list[str]) -> None:
        self.err_path = tmp / f"job-{first}.err"
        script = tmp / "job.py"
        script.write_text(JOB)
        env = {**os.environ, runlock._TTL_ENV: str(ttl)}
        for variable in _dist._JOB_VARIABLES:  # the job is labelled by its command, job.py
            env.pop(variable[0], None)
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, str(script), str(hot), str(first)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=Path(__file__).parents[2],
            )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), self.stderr()

    def close(self) -> None:
        out, _ = self.proc.communicate("close\n", timeout=120)
        assert self.proc.returncode == 0 and "CLOSED" in out, self.stderr()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)  # reaped: no zombie keeps its pid alive

    def stderr(self) -> str:
        return self.err_path.read_text()

    def warnings(self, text: str) -> list[str]:
        return [line for line in self.stderr().splitlines() if text in line]


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        if job.proc.poll() is None:
            job.kill()


def start(
    jobs: list[Job], tmp: Path, hot: Path, first: int, *, ttl: float = 120.0, prefix: list[str] | None = None
) -> Job:
    job = Job(tmp, hot, first, ttl=ttl, prefix=prefix or [])
    jobs.append(job)
    job.ready()
    return job


def locks(hot: Path) -> list[str]:
    """Run ids holding a lock (one object per heartbeat, under runs/<run>/)."""
    return sorted({p.parent.name for p in Path(hot, layout.RUN_DIR).rglob("*.json")})


def test_a_second_job_warns_once_naming_both_and_a_clean_close_releases(
    tmp_path: Path, jobs: list[Job]
) -> None:
    hot = tmp_path / "hot"
    first = start(jobs, tmp_path, hot, 1, ttl=8.0)
    assert not first.warnings(STARTING) and len(locks(hot)) == 1
    second = start(jobs, tmp_path, hot, 100, ttl=8.0)
    [warning] = second.warnings(STARTING)  # once, though it saved three times
    assert f"pid {first.proc.pid}," in warning and f"pid {second.proc.pid}," in warning
    assert str(hot) in warning and warning.startswith("WARNING")
    # The first job hears of the second at a heartbeat (every ttl / 4), once.
    deadline = time.monotonic() + 120
    while not first.warnings(LATER) and time.monotonic() < deadline:
        time.sleep(0.2)
    [later] = first.warnings(LATER)
    assert f"pid {second.proc.pid}," in later and f"pid {first.proc.pid}," in later
    second.close()
    first.close()
    assert len(second.warnings(STARTING)) == 1 and len(first.warnings(LATER)) == 1
    assert locks(hot) == []  # both released by close()
    third = start(jobs, tmp_path, hot, 200)
    assert not third.warnings(STARTING)
    third.close()


def test_a_killed_job_on_this_host_is_not_warned_about(tmp_path: Path, jobs: list[Job]) -> None:
    hot = tmp_path / "hot"
    crashed = start(jobs, tmp_path, hot, 1)  # ttl 120 s: only its vanished pid tells it is dead
    crashed.kill()
    [stale] = locks(hot)
    restarted = start(jobs, tmp_path, hot, 100)
    assert not restarted.warnings(STARTING), restarted.stderr()
    assert stale not in locks(hot)  # the dead job's lock was cleared
    restarted.close()


def _other_pid_namespace() -> list[str]:
    """A prefix running a command in a pid namespace of its own (another container, as far
    as pids go), killed with its launcher; skips where namespaces cannot be made."""
    prefix = ["unshare", "--pid", "--fork", "--kill-child"]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(
        [*prefix, "readlink", "/proc/self/ns/pid"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0 or probe.stdout.strip() == os.readlink("/proc/self/ns/pid"):
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()}")
    return prefix


def test_a_killed_jobs_lock_warns_until_it_expires_by_the_store_clock(
    tmp_path: Path, jobs: list[Job]
) -> None:
    prefix = _other_pid_namespace()
    hot = tmp_path / "hot"
    ttl = 3.0
    crashed = start(jobs, tmp_path, hot, 1, ttl=ttl, prefix=prefix)
    crashed.kill()  # its pid is not ours to check: only the store's clock tells it is dead
    [stale] = locks(hot)
    tier = Tier("hot", str(hot))
    mtime = max(i.mtime or 0.0 for i in tier.backend.list(layout.run_lock_prefix(stale)))
    # Wait out the lease by the store's clock (a probe's mtime), not this process's.
    while (store_time(tier) or 0.0) - mtime < ttl:
        time.sleep(0.5)
    restarted = start(jobs, tmp_path, hot, 100, ttl=ttl)
    assert not restarted.warnings(STARTING), restarted.stderr()
    assert stale not in locks(hot)  # expired locks are deleted by whoever finds them
    restarted.close()


def test_a_live_job_in_another_pid_namespace_is_warned_about(tmp_path: Path, jobs: list[Job]) -> None:
    prefix = _other_pid_namespace()
    hot = tmp_path / "hot"
    other = start(jobs, tmp_path, hot, 1, prefix=prefix)  # pid 1 of its own namespace
    second = start(jobs, tmp_path, hot, 100)
    [warning] = second.warnings(STARTING)
    assert "pid 1," in warning and str(hot) in warning
    second.close()
    other.close()
    assert locks(hot) == []
