from __future__ import annotations

import os
from pathlib import Path

import pytest
from cold_tiers import any_cold  # noqa: F401  (a fixture for every test: tests/cold_tiers.py)

from tierstore.storage import faults


@pytest.fixture(autouse=True)
def _no_armed_faults():
    faults.disarm()
    yield
    faults.disarm()


@pytest.fixture
def store(tmp_path: Path) -> str:
    """An empty hot-tier root."""
    return str(tmp_path / "hot")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


os.environ.setdefault("OMP_NUM_THREADS", "1")
