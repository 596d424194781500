"""`tierstore status` and `tierstore migrate` on a checkpoint left pending, text and JSON.
(`tierstore migrate` after a SIGKILL mid-migration: tests/tiers/test_migrator.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import save


def test_cli_status_and_json(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1)
    Path(cold).mkdir()  # a local tier path that does not exist is an error, except migrate's cold
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "tierstore", *a, "--hot", hot, "--cold", cold],
        capture_output=True,
        text=True,
        timeout=120,
    )
    before = json.loads(run("status", "--json").stdout)
    assert [(s["name"], s["state"]) for s in before] == [("step-0000000001", "pending")]
    moved = run("migrate", "--json")
    assert moved.returncode == 0 and json.loads(moved.stdout)[0]["state"] == "committed"
    assert json.loads(run("status", "--json").stdout)[0]["state"] == "committed"
    table = run("status").stdout
    assert "step-0000000001" in table and "committed" in table
