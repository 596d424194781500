"""Migrating a 384 MiB checkpoint to S3 (moto) keeps the migrator's memory growth under
concurrency x part size + 64 MiB (128 MiB, a third of the file): files are streamed, never
held whole. ``TIERSTORE_MEMTEST_BYTES=1073741824`` runs it at 1 GiB (about 30 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import Store, TieredWriter, list_checkpoints

pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")

MiB = 1 << 20
SIZE = int(os.environ.get("TIERSTORE_MEMTEST_BYTES", 384 << 20))
PART, PARTS_IN_FLIGHT = 16 * MiB, 4

MIGRATE = """
import json, sys
from tierstore import MigrationOptions, Store, migrate_pending
from tierstore.storage.registry import open_backend

hot, cold, part, inflight = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
options = {"part_size": part, "max_concurrency": inflight}
list(open_backend(cold, options).list("warm-up/"))  # import and connect before measuring

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark to now
before = status("VmRSS:")
[result] = migrate_pending(Store(hot, cold, cold_options=options),
                           config=MigrationOptions(concurrency=1, chunk_size=8 << 20))
print(json.dumps({"state": result.state.value, "error": result.error,
                  "growth": status("VmHWM:") - before, "bytes": result.bytes_total}))
"""


@pytest.mark.slow
def test_migrating_a_large_checkpoint_keeps_memory_bounded(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str], monkeypatch
) -> None:
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    hot, cold = str(tmp_path / "hot"), f"s3://{s3_bucket}/run"
    state = {"w": torch.ones(SIZE // 4, dtype=torch.float32)}
    dcp.save(state, storage_writer=TieredWriter(hot, step=1))
    del state
    proc = subprocess.run(
        [sys.executable, "-c", MIGRATE, hot, cold, str(PART), str(PARTS_IN_FLIGHT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "committed", result
    assert result["bytes"] >= SIZE
    bound = PARTS_IN_FLIGHT * PART + 64 * MiB
    print(
        f"migrated {result['bytes'] / MiB:.0f} MiB; peak RSS growth "
        f"{result['growth'] / MiB:.1f} MiB (bound {bound / MiB:.0f} MiB)"
    )
    assert result["growth"] < bound, f"grew {result['growth'] / MiB:.1f} MiB"
    assert [c.tiers for c in list_checkpoints(Store.of(hot, cold))] == [("hot", "cold")]
