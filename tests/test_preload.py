"""The tests' rank launcher (tests/launch.py) starts a Python script from a preloaded torch
(tests/preload.py): the rank must behave as ``subprocess.Popen([python, script])`` would
(its arguments, environment, directory and ``sys.path``, its exit code, an uncaught
exception, a signal's ``-N``, a session of its own), or a test of a SIGKILL or an exit
would pass here and mean nothing for a user's job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import kill_group, start_rank

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the preloader is Linux's (prctl)")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import helper_beside  # found as a script's directory is: first on sys.path
    mode = sys.argv[1]
    print(json.dumps({
        "argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__, "file": __file__,
        "env": os.environ.get("PRELOAD_PROBE"), "session": os.getsid(0) == os.getpid(),
        "parent": os.getppid(), "torch": "torch" in sys.modules,
    }), flush=True)
    if mode == "exit":
        sys.exit(7)
    if mode == "raise":
        raise RuntimeError("raised by the rank")
    if mode == "hang":
        import time
        time.sleep(60)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    (tmp_path / "helper_beside.py").write_text("")
    return path


def start(script: Path, mode: str, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PRELOAD_PROBE": mode, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return start_rank([sys.executable, str(script), mode], env, cwd=cwd, output=subprocess.PIPE)


def test_a_rank_is_preloaded_and_runs_as_python_runs_a_script(script: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = start(script, "exit", cwd)
    out, _ = proc.communicate(timeout=60)
    assert type(proc).__name__ == "Rank", "not started by the preloader: the suite lost its speed"
    assert proc.returncode == 7, out
    import json

    seen = json.loads(out.decode().splitlines()[0])
    assert seen["argv"] == ["exit"] and seen["cwd"] == str(cwd) and seen["env"] == "exit"
    assert seen["name"] == "__main__" and seen["file"] == str(script)
    assert seen["session"] and seen["parent"] == os.getpid()  # its own session; our child
    assert seen["torch"]  # what it was started for: torch imported before the script ran


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(script: Path, tmp_path: Path) -> None:
    proc = start(script, "raise", tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert b"Traceback" in out and b"RuntimeError: raised by the rank" in out, out


def test_sigkill_ends_the_rank_with_minus_9_and_kill_group_reaps_it(script: Path, tmp_path: Path) -> None:
    proc = start(script, "hang", tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline()  # it runs
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.returncode == -signal.SIGKILL
    kill_group(proc)  # a group already gone: nothing raised


ORPHAN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from launch import start_rank
    rank = start_rank([sys.executable, sys.argv[2], "exit"], {**os.environ, "PRELOAD_PROBE": "x"},
                      output=subprocess.DEVNULL)
    rank.wait(60)
    print(sys.modules["tierstore_test_preload"]._preloader.proc.pid, flush=True)
    time.sleep(60)
    """
)


def test_the_preloader_ends_with_a_test_process_that_was_sigkilled(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, "TIERSTORE_TEST_PRELOAD": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    test_process = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(Path(__file__).parent), str(script)],
        env=env,
        stdout=subprocess.PIPE,
    )
    assert test_process.stdout is not None
    preloader = int(test_process.stdout.readline())
    os.kill(test_process.pid, signal.SIGKILL)  # no atexit: only the kernel can end the preloader
    test_process.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{preloader}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{preloader}").exists(), "the preloader outlived its test process"
