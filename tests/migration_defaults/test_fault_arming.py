"""Fault injection is armed only by tests, through tierstore.testing (issue 36, item 4): no
variable in a production process's environment arms a fault point; a child a test starts
with ``armed_env`` is armed as it starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.errors import ConfigError
from tierstore.testing import faults

CODE = "from tierstore.storage import faults\nfaults.point('a')\nfaults.point('b')\nprint('survived')"


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Its own session: a fault that killed its process group must not reach the test's.
    return subprocess.run(
        [sys.executable, "-c", CODE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )


def test_the_fault_variables_alone_arm_nothing(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    done = run({"TIERSTORE_FAULTS": "b=kill", "TIERSTORE_FAULT_TRACE": str(trace), "PATH": ""})
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]
    assert not trace.exists()


def test_a_child_started_with_armed_env_is_armed_and_traced(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    done = run({**faults.armed_env("b=kill", trace=trace), "PATH": ""})
    assert done.returncode == -9 and "survived" not in done.stdout, done.stderr[-2000:]
    assert [line.split()[1] for line in trace.read_text().splitlines()] == ["a", "b"]


def test_armed_env_keeps_the_path_and_refuses_a_bad_spec(tmp_path: Path) -> None:
    env = faults.armed_env("a@2=raise", block_dir=tmp_path, environ={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(":") == [faults.HOOK_DIR, "/x"]
    assert env["TIERSTORE_FAULTS"] == "a@2=raise" and env["TIERSTORE_FAULT_BLOCK_DIR"] == str(tmp_path)
    with pytest.raises(ConfigError, match="bad fault spec"):
        faults.armed_env("a=boom")
