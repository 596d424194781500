from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cold_tiers import any_cold, switchable_cold  # noqa: F401  (fixtures for every test: tests/cold_tiers.py)

from tierstore.storage import faults, registry
from tierstore.storage.backend import Backend


@pytest.fixture(autouse=True)
def _no_armed_faults():
    faults.disarm()
    yield
    faults.disarm()


@pytest.fixture
def registered_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, type[Backend]], None]:
    """Registers a backend class under a scheme for one test: ``registered_backend("flaky",
    FlakyBackend)`` serves ``flaky://...``. The test registers into a copy of the registry
    (entry points loaded), and the registry is put back afterwards, so nothing leaks."""
    monkeypatch.setattr(registry, "_registry", dict(registry.registered_backends()))

    def register(scheme: str, backend: type[Backend]) -> None:
        registry.register_backend(scheme, backend)

    return register


@pytest.fixture
def hot_dir(tmp_path: Path) -> str:
    """An empty hot tier: a local directory, not yet created."""
    return str(tmp_path / "hot")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory for one test: what a mistyped URL must not create there."""
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TIERSTORE_TEST_PRELOAD", "1")  # ranks start from a preloaded torch: tests/preload.py
