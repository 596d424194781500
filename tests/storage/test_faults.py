"""Fault points: armed by spec or environment, firing on the chosen hit, traced, killing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierstore.errors import ConfigError, FaultInjected
from tierstore.storage import faults
from tierstore.testing.faults import armed_env


def test_fault_points_raise_on_the_chosen_hit() -> None:
    faults.point("x.y")  # unarmed: nothing
    faults.arm("x.*", hit=2)
    faults.point("x.y")
    with pytest.raises(FaultInjected, match="x.z"):
        faults.point("x.z")
    faults.point("x.y")  # fired once; spent


def test_fault_spec_parsing() -> None:
    specs = faults.parse_spec("a.b@3=kill; *=raise")
    assert [(s.pattern, s.hit, s.action) for s in specs] == [("a.b", 3, "kill"), ("*", 1, "raise")]
    for bad in ["a=boom", "@2=kill", "a@x=kill"]:
        with pytest.raises(ConfigError):
            faults.parse_spec(bad)


def test_fault_kill_from_environment_and_trace(tmp_path) -> None:
    trace = tmp_path / "trace"
    code = "from tierstore.storage import faults\nfaults.point('a')\nfaults.point('b')\nprint('survived')"
    env = {**armed_env("b=kill", trace=trace), "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -9 and "survived" not in proc.stdout
    assert [line.split()[1] for line in trace.read_text().splitlines()] == ["a", "b"]
