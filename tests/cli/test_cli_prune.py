"""``tierstore prune`` shows the errors and warnings it met (issue 22, item 5): a checkpoint it
could not delete is a FAILED line (an ``errors`` entry under ``--json``) naming tier and
checkpoint, and exit 1; a damaged manifest it skipped is a WARNING line. Real local
directories, the command in process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import committed, file_path, save

from tierstore.cli import main
from tierstore.format import layout


def undeletable(hot: str, step: int) -> None:
    """A real undeletable file, root or not: a directory where the data file was."""
    data = file_path(hot, committed(hot, step))
    data.unlink()
    (data / "inside").mkdir(parents=True)


def test_the_prune_command_prints_errors_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        save(hot, step)
    undeletable(hot, 1)
    undeletable(hot, 2)
    code = main(["prune", "--hot", hot, "--hot-keep-last", "2", "--yes"])
    out = capsys.readouterr().out
    assert code == 1, out
    [line] = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert f"hot {hot}" in line and layout.default_name(1) in line
    assert main(["prune", "--hot", hot, "--hot-keep-last", "1", "--yes", "--json"]) == 1
    [report] = json.loads(capsys.readouterr().out)
    assert len(report["errors"]) == 1 and layout.default_name(2) in report["errors"][0]


def test_the_prune_command_prints_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2):
        save(hot, step, cold, migrated=True)
    Path(cold, layout.manifest_key(layout.default_name(1))).write_text("{torn")
    assert main(["prune", "--hot", hot, "--cold", cold, "--hot-keep-last", "1", "--yes"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert f"hot {hot}" in line and layout.default_name(1) in line and "invalid" in line
