"""The `tierstore` command in real subprocesses, on a local hot tier and an S3 cold tier
served by moto: every command, with and without --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import committed, file_path, flip, load, matches, save

from tierstore import ReaderOptions, list_checkpoints
from tierstore.format import layout

pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")

SHAPE = (256, 256)  # a data file over 256 KiB: `ls` sizes are checked against it


@pytest.fixture
def tiers(tmp_path: Path, s3_bucket: str, s3_env: dict[str, str], monkeypatch) -> tuple[str, str]:
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    hot, cold = str(tmp_path / "hot"), f"s3://{s3_bucket}/run"
    for step in (1, 2, 3):  # saved without a cold tier: all three pending migration
        save(hot, step, shape=SHAPE)
    return hot, cold


def cli(*args: str, tiers: tuple[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    flags = ["--hot", tiers[0], "--cold", tiers[1]] if tiers else []
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


def ok_json(*args: str, tiers: tuple[str, str]) -> object:
    proc = cli(*args, "--json", tiers=tiers)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_command(tiers: tuple[str, str]) -> None:
    hot, cold = tiers
    names = [layout.default_name(s) for s in (1, 2, 3)]

    # status: pending before migration
    assert [(s["name"], s["state"]) for s in ok_json("status", tiers=tiers)] == [
        (n, "pending") for n in names
    ]
    assert "pending" in cli("status", tiers=tiers).stdout

    # migrate: progress on stderr, result on stdout; then nothing left
    proc = cli("migrate", tiers=tiers)
    assert proc.returncode == 0, proc.stderr
    assert all(f"{n}: committed" in proc.stdout for n in names)
    assert ok_json("migrate", tiers=tiers) == []

    # ls
    rows = ok_json("ls", tiers=tiers)
    assert [(r["step"], r["tiers"], r["migration"]) for r in rows] == [
        (s, ["hot", "cold"], "committed") for s in (1, 2, 3)
    ]
    assert all(r["size"] > 256 * 256 * 4 and r["age_seconds"] >= 0 for r in rows)
    text = cli("ls", tiers=tiers).stdout
    assert "step-0000000002" in text and "hot,cold" in text and "committed" in text

    # show
    shown = ok_json("show", "--step", "2", tiers=tiers)
    assert shown["name"] == names[1] and shown["tiers"] == ["hot", "cold"]
    assert {f["path"] for f in shown["files"]} == {".metadata", "__0_0.distcp"}
    assert "crc32c" in cli("show", "--step", "2", tiers=tiers).stdout

    # verify: clean, then a flipped byte in the hot copy of step 3
    checks = ok_json("verify", tiers=tiers)
    assert len(checks) == 12 and all(c["ok"] for c in checks)
    path = file_path(hot, committed(hot, 3))
    flip(path, 1000)
    proc = cli("verify", tiers=tiers)
    assert proc.returncode == 1
    assert f"DAMAGED  hot {hot}  {names[2]}  __0_0.distcp: CRC32C mismatch" in proc.stdout
    assert "11 ok, 1 damaged" in proc.stdout
    proc = cli("verify", "--json", tiers=tiers)
    assert proc.returncode == 1
    assert [c["file"] for c in json.loads(proc.stdout) if not c["ok"]] == ["__0_0.distcp"]
    path.unlink()  # repair by restoring below

    # prune: dry run by default, then for real
    assert "would prune" in cli("prune", "--hot-keep-last", "1", tiers=tiers).stdout
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3]
    reports = ok_json("prune", "--hot-keep-last", "1", "--yes", tiers=tiers)
    assert set(reports[0]["deleted"]) == set(names[:2])
    assert [c.step for c in list_checkpoints(hot)] == [3]

    # restore: from cold, verified; damaged step 3 first needs its hot manifest gone
    proc = cli("restore", "--step", "1", tiers=tiers)
    assert proc.returncode == 0 and "restored step-0000000001" in proc.stdout
    assert ok_json("restore", "--step", "2", tiers=tiers)["name"] == names[1]
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3]
    for step in (1, 2):  # restored means the hot copy alone loads the saved bytes
        assert matches(load(hot, shape=SHAPE, step=step, options=ReaderOptions(lease=False))[0], step, SHAPE)

    # gc: the hot copy of step 3 is missing a file; make an old dead attempt as debris
    dead = Path(hot, layout.attempt_prefix("step-0000000007", "20260101T000000Z-0badf00d"))
    dead.mkdir(parents=True)
    (dead / "__0_0.distcp").write_bytes(b"junk" * 10)
    old = time.time() - 7 * 86400
    os.utime(dead / "__0_0.distcp", (old, old))
    proc = cli("gc", tiers=tiers)
    assert proc.returncode == 0 and "would delete" in proc.stdout and "0badf00d" in proc.stdout
    report = ok_json("gc", "--yes", tiers=tiers)
    assert report["deleted"] is True and [(g["key"], g["reason"]) for g in report["garbage"]] == [
        (
            f"{layout.attempt_prefix('step-0000000007', '20260101T000000Z-0badf00d')}__0_0.distcp",
            "attempt named by no manifest",
        )
    ]
    assert not dead.exists()


def test_errors_and_usage(tiers: tuple[str, str]) -> None:
    proc = cli("show", "--name", "nope", tiers=tiers)
    assert proc.returncode == 1 and "CheckpointNotFound" in proc.stderr and "nope" in proc.stderr
    assert cli("ls").returncode == 2
    assert cli("bogus").returncode == 2
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore", "ls", "--hot", "s3://no-such-bucket-x/run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert proc.returncode == 1 and "no-such-bucket-x" in proc.stderr
