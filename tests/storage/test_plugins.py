"""Plugins are found through the entry point with no import in user code, and the core
works with the object-store client libraries absent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SAVE_AND_LOAD = """
import torch, torch.distributed.checkpoint as dcp, warnings
warnings.filterwarnings("ignore")
from tierstore import TieredReader, TieredWriter, list_checkpoints
url = {url!r}
dcp.save({{"w": torch.arange(10.0)}}, storage_writer=TieredWriter(url, step=1))
out = {{"w": torch.zeros(10)}}
dcp.load(out, storage_reader=TieredReader(url))
assert torch.equal(out["w"], torch.arange(10.0))
print("loaded", [c.name for c in list_checkpoints(url)])
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The example plugin, really installed (pip) into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT / "examples" / "plugin"),
        ],
        check=True,
        capture_output=True,
    )
    return target


def test_installed_plugin_scheme_works_without_import(plugin_site: Path, tmp_path: Path) -> None:
    code = SAVE_AND_LOAD.format(url=f"flatdir://{tmp_path}/store") + textwrap.dedent("""
        import sys
        assert "tierstore_flatdir" in sys.modules  # imported by the registry, lazily
    """)
    proc = run(code, PYTHONPATH=str(plugin_site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded ['step-0000000001']" in proc.stdout


def test_installed_plugin_passes_the_backend_contract(plugin_site: Path) -> None:
    """The plugin's own two-line contract suite, against the installed plugin: the contract
    grows (atomic replace on write, say), and the example must keep up with it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT / "examples" / "plugin"),
            str(ROOT / "examples" / "plugin" / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(plugin_site)},
        cwd=str(plugin_site),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_plugin_is_not_imported_until_used(plugin_site: Path) -> None:
    code = """
        import sys
        from tierstore.storage.registry import registered_backends
        assert registered_backends()["flatdir"] == "tierstore_flatdir:FlatDirBackend"
        assert "tierstore_flatdir" not in sys.modules
        print("lazy")
    """
    proc = run(code, PYTHONPATH=str(plugin_site))
    assert proc.returncode == 0 and "lazy" in proc.stdout, proc.stderr[-3000:]


def test_without_the_plugin_the_scheme_names_what_to_install(tmp_path: Path) -> None:
    proc = run(f"""
        from tierstore import TieredReader
        TieredReader("flatdir://{tmp_path}").tiers[0].backend
    """)
    assert proc.returncode != 0
    assert "no tierstore backend for scheme 'flatdir'" in proc.stderr
    assert "tierstore.backends" in proc.stderr


BLOCKER = """
import importlib.abc, sys
BLOCKED = ("s3fs", "gcsfs", "botocore", "aiobotocore", "boto3", "google")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked for this test")
sys.meta_path.insert(0, Block())
"""


def test_core_runs_with_s3fs_and_gcsfs_absent(tmp_path: Path) -> None:
    code = (
        BLOCKER
        + SAVE_AND_LOAD.format(url=str(tmp_path / "store"))
        + textwrap.dedent("""
        import sys
        assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), "an object-store client was imported"
        from tierstore.storage.registry import open_backend
        try:
            open_backend("s3://bucket/run")
        except Exception as err:
            print("s3:", type(err).__name__, err)
    """)
    )
    proc = run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded ['step-0000000001']" in proc.stdout
    # With tierstore-s3 installed but its dependencies missing, the error still says what to do.
    assert "s3: BackendNotFound" in proc.stdout and "tierstore-s3" in proc.stdout
