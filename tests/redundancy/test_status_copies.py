"""`tierstore status` says where each rank's files are kept for the checkpoints a node's
copies protect (issue 37): text and --json, the cold tier up or down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port
from test_reads_with_copies import Node

from tierstore.format import layout


def _status(
    node: Node, *more: str, cold: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", "status", "--hot", node.hot, "--cold", cold or node.cold, *more],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_status_names_the_scheme_the_copies_and_the_nodes_of_each_rank(tmp_path: Path) -> None:
    node = Node(tmp_path / "node")
    manifest = node.save(1)
    unprotected = node.save(2)
    node.protect(manifest)  # step 1 protected on this node (record: rank 0 on nodes 0 and 1)
    table = _status(node)
    assert table.returncode == 0, table.stderr
    line = next(
        row for row in table.stdout.splitlines() if row.strip().startswith(manifest.name) and "cop" in row
    )
    assert "Replicas(2)" in line and "2 copies" in line and "0:0+1" in line, table.stdout
    assert not any(unprotected.name in row and "cop" in row for row in table.stdout.splitlines())
    rows = {row["name"]: row for row in json.loads(_status(node, "--json").stdout)}
    assert rows[manifest.name]["copies"]["holders"] == {"0": [0, 1]}
    assert rows[manifest.name]["copies"]["scheme"] == "Replicas(2)"
    assert "copies" not in rows[unprotected.name]
    # The cold tier gone: the hot checkpoints, of unknown state, and still what protects them.
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    closed = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
    }
    down = _status(node, "--cold-wait", "1", cold="s3://bucket/run", env=closed)
    assert layout.default_name(1) in down.stdout and "0:0+1" in down.stdout, down.stdout + down.stderr
