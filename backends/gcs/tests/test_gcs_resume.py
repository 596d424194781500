"""Progress by chunks and resumed sessions on GCS (issue 38, item 3), on fake-gcs-server.

Each chunk GCS confirmed is counted as it is, and recorded with its session in the tier's
``session_dir``; a write of a key whose upload was interrupted (a killed `tierstore migrate`,
a suspended write) goes on in that session, sending only what follows, once the CRC32C of
its own first bytes is the one recorded. A record of other bytes is never resumed; a
session that holds other bytes than its record says never leaves them stored.

fake-gcs-server cannot answer a session's status query (``Content-Range: bytes */*``): it
completes the object with the bytes it has (fsouza/fake-gcs-server#1149; checked with the
version these tests run). The writer never sends one; a resumed write goes on from the
offset its record names, the only form of resume the emulator supports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gcs_fault_proxy import FaultProxy
from helpers import save

from tierstore.errors import TransientStorageError
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import ObjectWriter, crc32c_update
from tierstore.tiers.tier import Tier
from tierstore_gcs import GCSBackend

PART = 256 << 10
RESUMABLE_START = "uploadType=resumable"
CHUNK = "upload_id="  # every request of an open resumable session


@pytest.fixture
def sessions(tmp_path: Path) -> str:
    return str(tmp_path / "sessions")


@pytest.fixture
def tier(gcs_bucket: str, fault_proxy: FaultProxy, fast_retry: RetryPolicy, sessions: str) -> GCSBackend:
    """The tier through the fault proxy, recording its sessions in ``sessions``."""
    return GCSBackend(
        f"gs://{gcs_bucket}/resume",
        endpoint_url=fault_proxy.url,
        part_size=PART,
        retry=fast_retry,
        session_dir=sessions,
    )


def _write(backend: GCSBackend, key: str, data: bytes, *, finish: bool = True) -> ObjectWriter:
    out = backend.open_write(key)
    for start in range(0, len(data), 100_000):
        out.write(data[start : start + 100_000])
    if finish:
        out.close()
    return out


def _chunks_sent(proxy: FaultProxy) -> int:
    return sum(1 for method, path, action in proxy.log if method == "PUT" and CHUNK in path)


def _sessions_started(proxy: FaultProxy) -> int:
    return sum(1 for method, path, _ in proxy.log if method == "POST" and RESUMABLE_START in path)


def _records(sessions: str) -> list[Path]:
    return sorted(Path(sessions).glob("*.json")) if Path(sessions).exists() else []


def test_each_chunk_counts_once_gcs_confirmed_it(tier: GCSBackend, fault_proxy: FaultProxy) -> None:
    data = os.urandom(4 * PART + 12_345)
    reports: list[tuple[int, int]] = []  # (bytes reported, chunks GCS had answered by then)
    out = tier.open_write("obj")
    out.report_stored(lambda n: reports.append((n, _chunks_sent(fault_proxy))))
    for start in range(0, len(data), 100_000):
        out.write(data[start : start + 100_000])
    before_close = sum(n for n, _ in reports)
    out.close()
    assert before_close >= 3 * PART  # counted as GCS confirmed them, not all at close()
    assert [n for n, _ in reports] == [PART] * 4 + [12_345]
    assert all(
        sum(n for n, _ in reports[: i + 1]) <= chunks * PART + 12_345 for i, (_, chunks) in enumerate(reports)
    )
    assert out.stored == out.size == len(data)


def test_a_suspended_upload_goes_on_in_its_session(
    tier: GCSBackend, fault_proxy: FaultProxy, gcs_bucket: str, sessions: str
) -> None:
    data = os.urandom(6 * PART + 77)
    _write(tier, "obj", data[: 3 * PART + 1], finish=False).suspend()  # 3 chunks confirmed
    [record] = _records(sessions)
    assert json.loads(record.read_text())["offset"] == 3 * PART
    assert record.stat().st_mode & 0o077 == 0  # the session URL is a secret: the user's alone
    fault_proxy.clear()
    out = _write(tier, "obj", data)
    assert _sessions_started(fault_proxy) == 0
    assert _chunks_sent(fault_proxy) == 4  # parts 4-6 and the final 77 bytes; 7 from scratch
    assert GCSBackend(f"gs://{gcs_bucket}/resume").read_bytes("obj") == data
    assert out.stored == len(data) and _records(sessions) == []


def test_a_record_of_other_bytes_is_never_resumed(
    tier: GCSBackend, fault_proxy: FaultProxy, gcs_bucket: str, sessions: str
) -> None:
    _write(tier, "obj", os.urandom(3 * PART + 1), finish=False).suspend()
    data = os.urandom(5 * PART)
    with pytest.raises(TransientStorageError, match="holds 786432 bytes other than these"):
        _write(tier, "obj", data)
    assert _records(sessions) == []  # forgotten: the retry starts a session of its own
    fault_proxy.clear()
    _write(tier, "obj", data)
    assert _sessions_started(fault_proxy) == 1
    assert GCSBackend(f"gs://{gcs_bucket}/resume").read_bytes("obj") == data


def test_a_session_holding_other_bytes_than_its_record_never_leaves_them_stored(
    tier: GCSBackend, gcs_bucket: str, sessions: str
) -> None:
    """A record that lies (forged, or the CRC32C of bytes that are not those the session
    holds): the resumed object fails its CRC32C check, is deleted, and the write is
    transient, so the retry sends it whole."""
    data, other = os.urandom(5 * PART), os.urandom(3 * PART + 1)
    _write(tier, "obj", other, finish=False).suspend()
    [record] = _records(sessions)
    forged = json.loads(record.read_text())
    forged["crc32c"] = crc32c_update(0, data[: 3 * PART])  # claims our bytes
    record.write_text(json.dumps(forged))
    direct = GCSBackend(f"gs://{gcs_bucket}/resume")
    with pytest.raises(TransientStorageError, match="stored other bytes than these"):
        _write(tier, "obj", data)
    assert not direct.exists("obj") and _records(sessions) == []
    _write(tier, "obj", data)
    assert direct.read_bytes("obj") == data


def test_a_record_behind_its_session_never_leaves_other_bytes_stored(
    tier: GCSBackend, gcs_bucket: str, sessions: str
) -> None:
    """Killed after GCS confirmed a chunk and before the record said so: the resumed write
    sends again bytes the session holds. Real GCS keeps one copy of a repeated range;
    fake-gcs-server appends it, and the object fails its check (deleted, transient, sent
    whole by the retry). Either way only these bytes are ever left stored."""
    data = os.urandom(5 * PART)
    _write(tier, "obj", data[: 3 * PART + 1], finish=False).suspend()
    [record] = _records(sessions)
    behind = json.loads(record.read_text())
    behind.update(offset=2 * PART, crc32c=crc32c_update(0, data[: 2 * PART]))
    record.write_text(json.dumps(behind))
    direct = GCSBackend(f"gs://{gcs_bucket}/resume")
    try:
        _write(tier, "obj", data)
    except TransientStorageError:
        assert not direct.exists("obj")
        _write(tier, "obj", data)
    assert direct.read_bytes("obj") == data


def test_no_session_dir_records_nothing(gcs_bucket: str, tmp_path: Path) -> None:
    backend = GCSBackend(f"gs://{gcs_bucket}/plain", part_size=PART, session_dir=None)
    _write(backend, "obj", os.urandom(2 * PART + 1), finish=False).suspend()
    assert backend.session_dir is None and not list(tmp_path.rglob("*.json"))


# -- a killed `tierstore migrate` --------------------------------------------------------


def test_a_killed_migrate_goes_on_in_its_session(
    tmp_path: Path, fault_proxy: FaultProxy, gcs_bucket: str, gcs_env: dict[str, str], sessions: str
) -> None:
    hot, cold = str(tmp_path / "hot"), f"gs://{gcs_bucket}/run"
    manifest = save(hot, 1, shape=(2048, 1024)).manifest  # an 8 MiB shard: 8 chunks of 1 MiB
    assert manifest is not None
    [big] = [entry for entry in manifest.files if entry.size > 1 << 20]
    options = {"endpoint_url": fault_proxy.url, "part_size": 1 << 20, "session_dir": sessions}
    command = [sys.executable, "-m", "tierstore", "migrate", "--hot", hot, "--cold", cold]
    command += [f"--cold-option={k}={v}" for k, v in options.items()]
    env: dict[str, Any] = {**os.environ, **gcs_env}
    # GCS confirms three chunks; the fourth is refused (503) until the process is killed.
    fault_proxy.inject(503, method="PUT", match=CHUNK, skip=3, times=100_000)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not fault_proxy.actions("503"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert len(_records(sessions)) == 1
    fault_proxy.clear()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "step-0000000001: committed" in rerun.stdout
    assert _sessions_started(fault_proxy) == 0  # the killed run's session went on
    whole = big.size // (1 << 20) + 1  # chunks of a fresh upload, the final one included
    assert _chunks_sent(fault_proxy) == whole - 3
    cold_tier = Tier(
        "cold",
        cold,
        {"endpoint_url": os.environ.get("STORAGE_EMULATOR_HOST") or gcs_env["STORAGE_EMULATOR_HOST"]},
    )
    for entry in manifest.files:
        info = cold_tier.backend.stat(cold_tier.file_key(manifest.name, manifest.attempt, entry.path))
        assert (info.size, info.crc32c) == (entry.size, entry.crc32c)
    assert _records(sessions) == []
