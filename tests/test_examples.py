"""The shipped example runs: a short version of what `make demo` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_train_example_saves_restarts_and_resumes(tmp_path: Path) -> None:
    hot = tmp_path / "run" / "hot"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--hot", str(hot), "--steps", "10",
         "--save-every", "3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restart resumed from step-0000000006 (step 6)" in proc.stdout
    assert [c.step for c in list_checkpoints(str(hot))] == [3, 6, 9]
