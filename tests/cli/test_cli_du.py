"""``tierstore du`` (issue 26, item 3): every byte a tier holds, counted once, against what
is really on disk or in the bucket; pending migration bytes; a cold tier that is down."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cold_tiers import Cold
from helpers import save

from tierstore.cli import main
from tierstore.format import layout
from tierstore.progress import size_text
from tierstore.tiers.catalog import list_checkpoints


def du(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["du", *args])
    out, err = capsys.readouterr()
    return code, out, err


def on_disk(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_du_counts_every_stored_byte_once_per_tier_and_checkpoint(
    tmp_path: Path, any_cold: Cold, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, any_cold.url, migrated=True, cold_options=any_cold.options)
    save(hot, 2)  # hot only: pending
    stray = Path(hot, layout.DATA_DIR, "step-0000000009", "20200101T000000Z-deadbeef", "x.distcp")
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"g" * 1234)  # a dead attempt: no manifest names it
    options = [
        f"--cold-option={k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in any_cold.options.items()
        if k != "retry"
    ]
    code, out, err = du(capsys, "--hot", hot, "--cold", any_cold.url, *options, "--json")
    assert code == 0 and err == "", err
    body = json.loads(out)
    hot_body, cold_body = body["tiers"]
    files = on_disk(Path(hot))
    assert hot_body["bytes"] == sum(files.values()) and hot_body["objects"] == len(files)
    infos = {i.name: i for i in list_checkpoints(hot)}
    for c in hot_body["checkpoints"]:
        prefix = layout.attempt_prefix(c["name"], c["attempt"])
        manifest = files[layout.manifest_key(c["name"])]
        assert c["manifest_bytes"] == manifest
        assert c["stored_bytes"] == manifest + sum(s for k, s in files.items() if k.startswith(prefix))
        assert (c["size"], c["files"]) == (infos[c["name"]].size, infos[c["name"]].num_files)
    assert hot_body["other_bytes"] == hot_body["bytes"] - sum(
        c["stored_bytes"] for c in hot_body["checkpoints"]
    )
    assert hot_body["other_bytes"] >= 1234  # the dead attempt is not a checkpoint's
    free = os.statvfs(hot)
    assert abs(hot_body["free_bytes"] - free.f_bavail * free.f_frsize) < 64 << 20
    # The cold tier, as the server itself lists it.
    listed = list(any_cold.tier.backend.list(""))
    assert cold_body["bytes"] == sum(i.size for i in listed) and cold_body["objects"] == len(listed)
    assert [c["name"] for c in cold_body["checkpoints"]] == [layout.default_name(1)]
    assert cold_body["free_bytes"] is None if any_cold.kind != "local" else cold_body["free_bytes"] > 0
    pending = body["pending"]
    assert [p["name"] for p in pending["checkpoints"]] == [layout.default_name(2)]
    assert pending["bytes"] == infos[layout.default_name(2)].size
    # The human form: the same numbers, written by the one byte formatter.
    code, out, _ = du(capsys, "--hot", hot, "--cold", any_cold.url, *options)
    assert code == 0
    for c in hot_body["checkpoints"]:
        assert re.search(
            rf"{c['name']}\s+{c['step']}\s+{re.escape(size_text(c['size']))}\s+{c['files']}\s", out
        )
    assert f"pending migration: 1 checkpoints, {size_text(pending['bytes'])} still to upload" in out
    assert f"{size_text(hot_body['other_bytes'])}" in out


def test_du_without_a_cold_tier_has_no_pending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)
    code, out, _ = du(capsys, "--hot", hot, "--json")
    body = json.loads(out)
    assert code == 0 and body["pending"] is None and [t["role"] for t in body["tiers"]] == ["hot"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_du_shows_the_hot_tier_and_exits_1_when_the_cold_tier_is_down(tmp_path: Path) -> None:
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    hot = str(tmp_path / "hot")
    save(hot, 1)
    env: dict[str, Any] = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
    }
    for extra in ((), ("--json",)):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tierstore",
                "du",
                "--hot",
                hot,
                "--cold",
                "s3://bucket/run",
                "--cold-wait",
                "1",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 1, proc.stderr
        [line] = proc.stderr.splitlines()
        assert "cold tier s3://bucket/run is unreachable" in line and "showing the hot tier only" in line
        if extra:
            body = json.loads(proc.stdout)
            assert [t["role"] for t in body["tiers"]] == ["hot"] and body["pending"] is None
            assert [c["step"] for c in body["tiers"][0]["checkpoints"]] == [1]
        else:
            assert layout.default_name(1) in proc.stdout and "pending migration: unknown" in proc.stdout
