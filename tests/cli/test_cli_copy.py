"""`tierstore cp` (issue 26 item 2) in real subprocesses: the summary, `ls` of the destination,
exit codes 0, 1, 2 and 130, and the rerun after Ctrl-C. What the copy guarantees:
tests/tiers/test_copy.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import file_path, flip, load, matches, saved

from tierstore import list_checkpoints
from tierstore.format import layout
from tierstore.testing.faults import armed_env

BIG = (1024, 1024)  # 4 MiB


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cp_copies_prints_a_summary_and_the_destination_lists_it(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    manifest = saved(hot, 1)
    saved(hot, 2)
    proc = cli("cp", "--hot", hot, "--step", "1", "--to", dest)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"copied {manifest.name} (step 1) in {dest} from hot {hot}: 2 files")
    assert "sent 2 files" in proc.stdout and "already there" not in proc.stdout
    assert f"{manifest.name}: 100%" in proc.stderr  # the progress line, on stderr
    listed = cli("ls", "--hot", dest)
    assert listed.returncode == 0 and manifest.name in listed.stdout
    assert layout.default_name(2) not in listed.stdout
    assert matches(load(dest)[0], 1)
    again = cli("cp", "--hot", hot, "--name", manifest.name, "--to", f"file://{dest}", "--json")
    assert again.returncode == 0 and again.stderr == ""
    body = json.loads(again.stdout)
    assert body["already_there"] is True and body["bytes_sent"] == 0 and body["attempt"] == manifest.attempt


def test_cp_exit_codes(tmp_path: Path) -> None:
    hot, dest = str(tmp_path / "hot"), str(tmp_path / "dest")
    manifest = saved(hot, 1)
    missing = cli("cp", "--hot", hot, "--step", "7", "--to", dest)
    assert missing.returncode == 1 and "CheckpointNotFound" in missing.stderr
    no_tier = cli("cp", "--hot", str(tmp_path / "nope"), "--step", "1", "--to", dest)
    assert no_tier.returncode == 1 and "does not exist" in no_tier.stderr
    for usage in (
        ("cp", "--hot", hot, "--to", dest),  # neither --step nor --name
        ("cp", "--hot", hot, "--step", "1"),  # no --to
        ("cp", "--hot", hot, "--step", "1", "--name", manifest.name, "--to", dest),
        ("cp", "--hot", hot, "--step", "1", "--to", dest, "--to-option", "novalue"),
    ):
        assert cli(*usage).returncode == 2, usage
    other = saved(str(tmp_path / "other"), 1)  # another attempt of step 1 there
    refused = cli("cp", "--hot", hot, "--step", "1", "--to", str(tmp_path / "other"))
    assert (
        refused.returncode == 1 and "CheckpointExists" in refused.stderr and other.attempt in refused.stderr
    )
    flip(file_path(hot, manifest))
    damaged = cli("cp", "--hot", hot, "--step", "1", "--to", dest)
    assert damaged.returncode == 1 and "ChecksumMismatch" in damaged.stderr
    for named in (manifest.name, layout.data_file_name(0, 0), f"hot {hot}"):
        assert named in damaged.stderr, named
    assert list_checkpoints(dest) == []


def test_ctrl_c_mid_cp_then_the_rerun_finishes(tmp_path: Path) -> None:
    hot, dest, gates = str(tmp_path / "hot"), str(tmp_path / "dest"), tmp_path / "gates"
    gates.mkdir()
    manifest = saved(hot, 1, shape=BIG)
    env = {**os.environ, **armed_env("transfer.after_chunk=block", block_dir=gates)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "cp", "--hot", hot, "--step", "1", "--to", dest],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    while not list(gates.glob("transfer.after_chunk.*.reached")) and proc.poll() is None:
        time.sleep(0.05)  # polls the gate file; no time is asserted
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    [line] = [x for x in err.splitlines() if x.startswith("tierstore cp:")]
    assert "interrupted: copied" in line and "run the same `tierstore cp` again" in line
    assert "Traceback" not in err
    assert list_checkpoints(dest) == []  # nothing half-copied is listed
    again = cli("cp", "--hot", hot, "--step", "1", "--to", dest)
    assert again.returncode == 0 and f"copied {manifest.name}" in again.stdout, again.stderr
    assert cli("verify", "--hot", dest).returncode == 0
