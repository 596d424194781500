"""``tierstore ls`` and ``show`` name each checkpoint's run and structure (issue 25), in real
subprocesses on a local hot tier: a run named for the save, the job of one that was not (in
parentheses: display only), nothing for a checkpoint saved before runs were recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import committed, save

from tierstore import _dist
from tierstore.format import layout
from tierstore.format.manifest import _checksum


def tierstore(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _unrecorded(hot: str, step: int) -> None:
    """Rewrite a committed manifest as one written before runs were recorded."""
    path = Path(hot, layout.manifest_key(layout.default_name(step)))
    body = json.loads(path.read_text())
    for key in ("run", "job", "fingerprint", "checksum"):
        body.pop(key, None)
    path.write_text(json.dumps({**body, "checksum": _checksum(body)}))


@pytest.fixture
def hot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for variable, _ in _dist._JOB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    hot = str(tmp_path / "hot")
    save(hot, 1, run="ablation-B")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    save(hot, 2)
    monkeypatch.delenv("SLURM_JOB_ID")
    save(hot, 3)
    _unrecorded(hot, 3)
    return hot


def test_ls_shows_the_run_and_the_structure(hot: str) -> None:
    header, *lines = tierstore("ls", "--hot", hot).stdout.splitlines()
    columns = header.split()
    assert columns[columns.index("tiers") + 1 : columns.index("tiers") + 3] == ["run", "structure"]
    assert columns[-1] == "migration"
    short = committed(hot, 1).fingerprint.removeprefix("sha256:")[:8]  # type: ignore[union-attr]
    assert lines[0].split()[-3:] == ["ablation-B", short, "-"]
    assert lines[1].split()[-5:] == ["(slurm", "job", "4242)", short, "-"]  # one structure, 3 saves
    assert lines[2].split()[-3:] == ["-", "-", "-"]  # saved before runs were recorded
    rows = json.loads(tierstore("ls", "--hot", hot, "--json").stdout)
    assert [(r["run"], r["job"]) for r in rows] == [
        ("ablation-B", None),
        (None, "slurm job 4242"),
        (None, None),
    ]
    assert [r["fingerprint"] for r in rows] == [committed(hot, 1).fingerprint] * 2 + [None]


def test_ls_without_runs_or_fingerprints_has_no_such_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable, _ in _dist._JOB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    hot = str(tmp_path / "hot")
    save(hot, 1)
    _unrecorded(hot, 1)
    header = tierstore("ls", "--hot", hot).stdout.splitlines()[0]
    assert "run" not in header.split() and "structure" not in header.split()


def test_show_names_the_run_whether_it_was_named_and_the_fingerprint(hot: str) -> None:
    def shown(step: int) -> list[str]:
        return tierstore("show", "--hot", hot, "--step", str(step)).stdout.splitlines()

    fingerprint = committed(hot, 1).fingerprint
    assert "run: ablation-B (named)" in shown(1) and f"structure: {fingerprint}" in shown(1)
    assert "run: none named  job: slurm job 4242" in shown(2) and f"structure: {fingerprint}" in shown(2)
    assert "run: none recorded" in shown(3) and "structure: not recorded" in shown(3)
    bodies = [
        json.loads(tierstore("show", "--hot", hot, "--step", str(s), "--json").stdout) for s in (1, 2, 3)
    ]
    assert [(b["run"], b["job"], b["fingerprint"]) for b in bodies] == [
        ("ablation-B", None, fingerprint),
        (None, "slurm job 4242", fingerprint),
        (None, None, None),  # as `ls --json` has them: present, null
    ]
