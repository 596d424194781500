"""Progress by parts and resumed multipart uploads (issue 38, item 3): each part S3
acknowledged is counted as it is; a write of a key whose upload was interrupted (a killed
`tierstore migrate`, a suspended write, a retried file) sends only the parts S3 does not hold
with these very bytes; a stored part with other bytes is sent again, never reused."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import save
from s3_fault_proxy import FaultProxy
from s3_test_support import FAST_RETRY, PART, backend_options

from tierstore import Store
from tierstore.format.manifest import Manifest
from tierstore.migration.jobs import MigrationOptions, MigrationState
from tierstore.migration.status import migrate_pending
from tierstore.storage.backend import crc32c_update
from tierstore.tiers.tier import Tier
from tierstore_s3 import S3Backend
from tierstore_s3._checksum import encode

MakeBackend = Callable[..., S3Backend]
BIG = (2560, 4096)  # a 40 MiB shard: 8 parts of 5 MiB and a small last one
FAST = MigrationOptions(retry=FAST_RETRY)


def _write(backend: S3Backend, key: str, data: bytes, *, finish: bool = True) -> Any:
    out = backend.open_write(key)
    for start in range(0, len(data), 1 << 20):
        out.write(data[start : start + (1 << 20)])
    if finish:
        out.close()
    return out


def _parts_sent(proxy: FaultProxy) -> list[int]:
    """Part numbers the proxy forwarded to moto and moto stored, in order."""
    numbers = []
    for seen in proxy.seen("PUT", "partNumber="):
        if seen.action == "forward" and seen.status == 200:
            numbers.append(int(seen.path.split("partNumber=")[1].split("&")[0]))
    return numbers


def _pending_parts(client: Any, bucket: str) -> dict[int, int]:
    [upload] = client.list_multipart_uploads(Bucket=bucket)["Uploads"]
    listed = client.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return {part["PartNumber"]: part["Size"] for part in listed.get("Parts", [])}


# -- progress -------------------------------------------------------------------------------


def test_each_part_counts_once_s3_acknowledged_it(make_backend: MakeBackend, fault_proxy: FaultProxy) -> None:
    backend = make_backend("progress", endpoint=fault_proxy.url)
    data = os.urandom(4 * PART + 1000)  # parts 1-4 of 5 MiB, part 5 of 1000 bytes
    reports: list[tuple[int, int]] = []  # (bytes reported, bytes moto held in parts by then)

    def report(n: int) -> None:
        held = sum(PART if number < 5 else 1000 for number in _parts_sent(fault_proxy))
        reports.append((n, held))

    out = backend.open_write("obj")
    out.report_stored(report)
    for start in range(0, len(data), 1 << 20):
        out.write(data[start : start + (1 << 20)])
    before_close = sum(n for n, _ in reports)
    out.close()
    assert sorted(n for n, _ in reports) == [1000] + [PART] * 4  # each part once
    assert before_close >= 2 * PART  # counted as they landed, not all at close()
    counted = 0
    for n, held in reports:
        counted += n
        assert counted <= held, reports  # never ahead of what S3 holds
    assert out.stored == out.size == len(data)


def test_a_small_object_counts_whole_when_stored(make_backend: MakeBackend) -> None:
    out = make_backend("progress").open_write("small")
    reports: list[int] = []
    out.report_stored(reports.append)
    out.write(b"x" * 1000)
    assert reports == []
    out.close()
    assert reports == [1000]


# -- resume --------------------------------------------------------------------------------


def test_a_suspended_upload_is_resumed_sending_only_what_s3_lacks(
    make_backend: MakeBackend, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("resume", endpoint=fault_proxy.url)
    data = os.urandom(6 * PART + 77)
    first = _write(backend, "obj", data[: 3 * PART + 1], finish=False)  # parts 1-3 shipped
    first.suspend()
    stored = _pending_parts(boto_client, s3_bucket)
    assert stored and set(stored) <= {1, 2, 3}
    fault_proxy.reset()
    out = _write(backend, "obj", data)
    assert not fault_proxy.seen("POST", "?uploads")  # no new upload: the pending one goes on
    assert sorted(_parts_sent(fault_proxy)) == [n for n in range(1, 8) if n not in stored]
    assert backend.read_bytes("obj") == data
    assert backend.stat("obj").crc32c == crc32c_update(0, data) == out.crc32c
    assert not boto_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")


def test_a_stored_part_with_other_bytes_is_sent_again(
    make_backend: MakeBackend, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("forged", endpoint=fault_proxy.url)
    data = os.urandom(4 * PART + 5)
    _write(backend, "obj", data[: 3 * PART + 1], finish=False).suspend()
    [upload] = boto_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert set(_pending_parts(boto_client, s3_bucket)) == {1, 2, 3}
    # Someone overwrites part 2 with other bytes of the same size, as a forged upload would.
    other = os.urandom(PART)
    boto_client.upload_part(
        Bucket=s3_bucket, Key=upload["Key"], UploadId=upload["UploadId"], PartNumber=2, Body=other
    )
    fault_proxy.reset()
    _write(backend, "obj", data)
    assert sorted(_parts_sent(fault_proxy)) == [2, 4, 5]  # 1 and 3 hold our bytes: reused
    assert backend.read_bytes("obj") == data


def test_a_part_is_reused_only_for_its_size_and_checksum() -> None:
    from tierstore_s3._resume import StoredPart

    body = os.urandom(1000)
    crc, md5 = crc32c_update(0, body), hashlib.md5(body).hexdigest()
    view = memoryview(body)
    assert StoredPart(1000, f'"{md5}"', None).holds(1000, crc, view)  # the ETag is the MD5
    assert StoredPart(1000, f'"{md5}"', encode(crc)).holds(1000, crc, view)
    # A listed CRC32C decides, whatever the ETag says (SSE-KMS ETags are not MD5s).
    assert StoredPart(1000, '"0123"', encode(crc)).holds(1000, crc, view)
    assert not StoredPart(1000, f'"{md5}"', encode(crc ^ 1)).holds(1000, crc, view)
    assert not StoredPart(999, f'"{md5}"', encode(crc)).holds(1000, crc, view)
    assert not StoredPart(1000, '"0123"', None).holds(1000, crc, view)


def test_gc_still_aborts_an_interrupted_upload_and_the_next_write_starts_over(
    make_backend: MakeBackend, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("gc", endpoint=fault_proxy.url)
    data = os.urandom(2 * PART + 3)
    _write(backend, "obj", data[: PART + 1], finish=False).suspend()
    far = 1e12  # moto dates every upload 2010: any grace has passed
    assert backend.abort_stale_uploads(older_than=3600, now=far, dry_run=False) == ["obj"]
    fault_proxy.reset()
    _write(backend, "obj", data)
    assert len(fault_proxy.seen("POST", "?uploads")) == 1
    assert sorted(_parts_sent(fault_proxy)) == [1, 2, 3]
    assert backend.read_bytes("obj") == data


def test_a_retried_file_reuses_its_parts_and_counts_them_once(
    tmp_path: Path, fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    """A part that fails past its own retries fails the file; the migrator's retry of the
    file resumes the upload (parts 1-3 are not sent again) and the progress, taken back when
    the first try failed, never counts a byte twice."""
    hot = str(tmp_path / "hot")
    manifest = save(hot, 1, shape=BIG).manifest
    assert manifest is not None
    options = backend_options(fault_proxy.url)
    fault_proxy.add("internal", method="PUT", contains=("partNumber=4",), times=FAST_RETRY.attempts)
    samples: list[int] = []
    store = Store(hot, f"s3://{s3_bucket}/run", cold_options=options)
    [result] = migrate_pending(store, config=FAST, progress=lambda _, done, total: samples.append(done))
    assert result.state is MigrationState.COMMITTED
    refused = [s for s in fault_proxy.seen("PUT", "partNumber=4") if s.action == "internal"]
    assert len(refused) == FAST_RETRY.attempts  # part 4 failed the first try of the file
    sent = _parts_sent(fault_proxy)
    assert sorted(sent) == list(range(1, 10)), sent  # each part stored once: none sent again
    assert max(samples) == samples[-1] == manifest.total_size
    assert len({s for s in samples if 0 < s < manifest.total_size}) >= 4  # part by part
    _check_cold(Tier("cold", f"s3://{s3_bucket}/run", backend_options(options["endpoint_url"])), manifest)


# -- a killed `tierstore migrate` --------------------------------------------------------


def _migrate_command(hot: str, cold: str, proxy: FaultProxy) -> list[str]:
    options = {
        "endpoint_url": proxy.url,
        "key": "testing",
        "secret": "testing",
        "region": "us-west-2",
        "part_size": PART,
        "max_concurrency": 2,
    }
    command = [sys.executable, "-m", "tierstore", "migrate", "--hot", hot, "--cold", cold]
    return command + [f"--cold-option={k}={v}" for k, v in options.items()]


def _kill_at_part(command: list[str], proxy: FaultProxy, number: int) -> None:
    """Run ``command`` and SIGKILL it once it sent every part before ``number`` and part
    ``number`` itself (refused, never stored), then wait until the parts it had in flight
    reached moto: a kill mid-file, after S3 acknowledged ``number - 1`` parts."""
    proxy.add("reset", method="PUT", contains=(f"partNumber={number}",), times=1000)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not set(range(1, number + 1)) <= {
        int(s.path.split("partNumber=")[1].split("&")[0]) for s in proxy.seen("PUT", "partNumber=")
    }:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    while proxy.in_flight("part"):
        time.sleep(0.01)


def _check_cold(tier: Tier, manifest: Manifest) -> None:
    for entry in manifest.files:
        info = tier.backend.stat(tier.file_key(manifest.name, manifest.attempt, entry.path))
        assert (info.size, info.crc32c) == (entry.size, entry.crc32c), entry.path


def test_a_killed_migrate_is_resumed_sending_only_the_parts_s3_lacks(
    tmp_path: Path, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    hot, cold = str(tmp_path / "hot"), f"s3://{s3_bucket}/run"
    manifest = save(hot, 1, shape=BIG).manifest
    assert manifest is not None
    command = _migrate_command(hot, cold, fault_proxy)
    _kill_at_part(command, fault_proxy, 5)
    stored = _pending_parts(boto_client, s3_bucket)
    assert {1, 2, 3, 4} <= set(stored) and 5 not in stored, stored  # about half the file
    fault_proxy.reset()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "step-0000000001: committed" in rerun.stdout
    sent = _parts_sent(fault_proxy)
    assert sorted(sent) == [n for n in range(1, 10) if n not in stored], sent  # none sent again
    assert not fault_proxy.seen("POST", "?uploads")  # the killed run's upload went on
    _check_cold(Tier("cold", cold, backend_options(fault_proxy.url)), manifest)
    assert not boto_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
