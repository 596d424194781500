"""The three distributions build as wheels that carry what an installed tierstore needs (issue
38, item 5): the ``tierstore`` command, the backends' ``tierstore.backends`` entry points, the
``py.typed`` markers, and no tests. ``make wheels`` builds them with ``python -m build``; here
pip builds them through the same PEP 517 backend, from a copy of each source tree (no stale
``build/`` folder) and without the network (``--no-build-isolation``: the venv's setuptools)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# source tree: (wheel, entry points by group, top-level package)
DISTRIBUTIONS = {
    ".": (
        "tierstore-0.1.0-py3-none-any.whl",
        {"console_scripts": {"tierstore": "tierstore.cli:main"}},
        "tierstore",
    ),
    "backends/s3": (
        "tierstore_s3-0.1.0-py3-none-any.whl",
        {"tierstore.backends": {"s3": "tierstore_s3:S3Backend"}},
        "tierstore_s3",
    ),
    "backends/gcs": (
        "tierstore_gcs-0.1.0-py3-none-any.whl",
        {"tierstore.backends": {"gs": "tierstore_gcs:GCSBackend", "gcs": "tierstore_gcs:GCSBackend"}},
        "tierstore_gcs",
    ),
}
_LEFT_OUT = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "tests", ".*")


def _source_copy(tree: str, into: Path) -> Path:
    """What the build reads of ``tree``: its pyproject, README and package."""
    source, copy = ROOT / tree, into / tree.replace("/", "-").replace(".", "tierstore")
    copy.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        if (source / name).exists():
            shutil.copy(source / name, copy / name)
    package = DISTRIBUTIONS[tree][2]
    shutil.copytree(source / package, copy / package, ignore=_LEFT_OUT)
    return copy


def _entry_points(wheel: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # names keep their case
    parser.read_string(wheel.read(name).decode())
    return {group: dict(parser[group]) for group in parser.sections()}


def test_the_three_wheels_build_with_their_entry_points_and_typing(tmp_path: Path) -> None:
    sources = [str(_source_copy(tree, tmp_path / "src")) for tree in DISTRIBUTIONS]
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + sources,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(w for w, _, _ in DISTRIBUTIONS.values())
    for wheel_name, entry_points, package in DISTRIBUTIONS.values():
        with zipfile.ZipFile(out / wheel_name) as wheel:
            assert _entry_points(wheel) == entry_points, wheel_name
            names = wheel.namelist()
            assert f"{package}/py.typed" in names and f"{package}/__init__.py" in names, wheel_name
            top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
            assert top == {package}, (wheel_name, top)  # no tests, no other folder


def test_make_wheels_builds_the_three_with_python_m_build() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    proc = subprocess.run(
        ["make", "-n", "-s", "wheels"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for tree in DISTRIBUTIONS:
        assert f"-m build -q --outdir dist {tree} " in proc.stdout.replace("&&", " "), proc.stdout
