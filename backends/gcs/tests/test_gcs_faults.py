"""Faults real GCS produces and fake-gcs-server does not, injected by a proxy in between.

Every test reads its outcome back from the emulator directly, not through the proxy.
"""

from __future__ import annotations

import logging
import os

import pytest
from gcs_fault_proxy import FaultProxy

from tierstore.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    PublishConflict,
    StorageError,
    TransientStorageError,
)
from tierstore.retry import RetryPolicy
from tierstore_gcs import GCSBackend

PART = 256 << 10  # the part size of the `proxied` fixture
RESUMABLE_START = "uploadType=resumable"
CHUNK = "upload_id="  # every request of an open resumable session
MULTIPART = "uploadType=multipart"
MEDIA = "alt=media"


def _write(backend: GCSBackend, key: str, data: bytes, step: int = 100_000) -> None:
    with backend.open_write(key) as out:
        for start in range(0, len(data), step):
            out.write(data[start : start + step])


def test_large_write_survives_throttling_errors_and_drops(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    assert proxied.part_size == PART
    data = os.urandom(4 * PART + 12_345)  # four whole parts, then a short final one
    # PUTs: part 1 (503), part 1 again, part 2 (dropped), part 2 again, parts 3 and 4,
    # the final request (500), the final request again.
    fault_proxy.inject(429, method="POST", match=RESUMABLE_START)
    fault_proxy.inject(503, method="PUT", match=CHUNK)
    fault_proxy.inject("drop", method="PUT", match=CHUNK, skip=2)
    fault_proxy.inject(500, method="PUT", match=CHUNK, skip=6)
    _write(proxied, "ckpt/big.distcp", data)
    assert direct.read_bytes("ckpt/big.distcp") == data
    assert [a for _, _, a in fault_proxy.log if a != "forward"] == ["429", "503", "drop", "500"]


def test_small_write_and_reads_survive_faults(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    data = os.urandom(PART // 2)
    fault_proxy.inject(503, method="POST", match=MULTIPART)
    fault_proxy.inject("drop", method="POST", match=MULTIPART)
    _write(proxied, "ckpt/small", data)
    assert direct.read_bytes("ckpt/small") == data
    fault_proxy.inject(429, method="GET", match=MEDIA)
    fault_proxy.inject("drop", method="GET", match=MEDIA)
    fault_proxy.inject(503, method="GET", match=MEDIA)
    assert proxied.read_bytes("ckpt/small") == data
    # The upload, then one GET for the read: no metadata request before it.
    assert [method for method, _, _ in fault_proxy.actions("forward")] == ["POST", "GET"]


def test_list_stat_delete_survive_faults(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    direct.publish("l/a", b"a")
    fault_proxy.inject(503, method="GET", times=2)
    assert [i.key for i in proxied.list("l/")] == ["l/a"]
    fault_proxy.inject("drop", method="DELETE")
    proxied.delete("l/a")
    assert not direct.exists("l/a")


def test_publish_survives_transient_failures(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    fault_proxy.inject(503, method="POST", match="ifGenerationMatch=0")
    fault_proxy.inject(429, method="POST", match="ifGenerationMatch=0")
    proxied.publish("manifests/step-1.json", b'{"step": 1}')
    assert direct.read_bytes("manifests/step-1.json") == b'{"step": 1}'
    with pytest.raises(PublishConflict):  # still exclusive after the retries
        proxied.publish("manifests/step-1.json", b'{"step": 1}')


def test_permanent_403_is_not_retried_and_names_key_and_tier(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    proxied.label = "cold gs://bucket/faults"
    fault_proxy.inject(403, method="POST", match=MULTIPART)
    with pytest.raises(StorageError) as info:
        proxied.publish("manifests/step-2.json", b"{}")
    err = info.value
    assert not isinstance(err, TransientStorageError)
    assert (err.key, err.tier) == ("manifests/step-2.json", "cold gs://bucket/faults")
    assert "403" in str(err) and "permanent" in str(err)
    assert "manifests/step-2.json" in str(err) and "cold gs://bucket/faults" in str(err)
    assert [(m, a) for m, _, a in fault_proxy.log] == [("POST", "403")]  # exactly one try
    assert not direct.exists("manifests/step-2.json")


def test_ambiguous_publish_that_landed_is_a_success(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    # The first conditional upload reaches GCS and creates the object, but its answer
    # is lost; the retry gets 412; the read-back finds our bytes (invariant 6).
    fault_proxy.inject("lose_answer", method="POST", match="ifGenerationMatch=0")
    proxied.publish("manifests/step-3.json", b'{"ours": true}')
    assert direct.read_bytes("manifests/step-3.json") == b'{"ours": true}'
    assert [a for _, _, a in fault_proxy.log][:2] == ["lose_answer", "forward"]
    assert any(MEDIA in path for _, path, _ in fault_proxy.log)  # it did read back


def test_ambiguous_publish_against_another_writer_is_a_conflict(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    # Our first attempt never arrives (dropped), but looks the same to us as a lost
    # answer; meanwhile another writer published. The read-back must say "not ours".
    direct.publish("manifests/step-4.json", b'{"theirs": true}')
    fault_proxy.inject("drop", method="POST", match="ifGenerationMatch=0")
    with pytest.raises(PublishConflict) as info:
        proxied.publish("manifests/step-4.json", b'{"ours!": true}')
    assert info.value.key == "manifests/step-4.json"
    assert direct.read_bytes("manifests/step-4.json") == b'{"theirs": true}'


def test_lost_answer_to_final_chunk_is_resolved_by_reading_back(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    # The final request lands and completes the object; its answer is lost. The retry
    # finds the session gone and checks the stored object's size and CRC32C instead.
    data = os.urandom(2 * PART + 999)
    fault_proxy.inject("lose_answer", method="PUT", match=CHUNK, skip=2)
    _write(proxied, "ckpt/final-lost", data)
    assert direct.read_bytes("ckpt/final-lost") == data
    assert fault_proxy.actions("lose_answer")


@pytest.mark.parametrize(
    "method, match, action, size",
    [
        ("POST", MULTIPART, "corrupt_body", PART // 3),  # one-request upload
        ("PUT", CHUNK, "corrupt_body", 3 * PART + 7),  # a part of a resumable upload
        ("PUT", CHUNK, "corrupt_crc", 3 * PART + 7),  # GCS's answer itself is off
    ],
)
def test_checksum_mismatch_is_detected_at_close_and_the_object_removed(
    proxied: GCSBackend,
    direct: GCSBackend,
    fault_proxy: FaultProxy,
    method: str,
    match: str,
    action: str,
    size: int,
) -> None:
    fault_proxy.inject(action, method=method, match=match, times=99)
    data = os.urandom(size)
    with pytest.raises(ChecksumMismatch) as info:
        _write(proxied, "ckpt/damaged", data)
    assert info.value.key == "ckpt/damaged" and proxied.label in str(info.value)
    assert not direct.exists("ckpt/damaged")


def test_chunk_landing_twice_on_the_emulator_is_caught(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    # fake-gcs-server appends every chunk it gets; when a chunk's answer is lost after
    # it landed, the retry stores it twice (real GCS would not). Caught at close.
    fault_proxy.inject("lose_answer", method="PUT", match=CHUNK)
    with pytest.raises(ChecksumMismatch, match="size"):
        _write(proxied, "ckpt/twice", os.urandom(2 * PART + 5))
    assert not direct.exists("ckpt/twice")


def test_abort_of_a_resumable_upload_leaves_nothing(
    proxied: GCSBackend, direct: GCSBackend, fault_proxy: FaultProxy
) -> None:
    with pytest.raises(RuntimeError):
        with proxied.open_write("ckpt/aborted") as out:
            out.write(os.urandom(3 * PART))
            out.write(b"more")  # parts went up; the session is open
            raise RuntimeError("rank died")
    assert not direct.exists("ckpt/aborted")
    assert list(direct.list("ckpt/")) == []
    assert ("DELETE", "forward") in {(m, a) for m, p, a in fault_proxy.log if CHUNK in p}


def test_retries_are_bounded_and_answers_are_not_retried(
    proxied: GCSBackend, fault_proxy: FaultProxy
) -> None:
    fault_proxy.inject(503, method="GET", times=99)
    with pytest.raises(TransientStorageError) as info:
        proxied.stat("x/y")
    assert info.value.key == "x/y"
    assert len(fault_proxy.log) == proxied.retry.attempts
    fault_proxy.clear()
    with pytest.raises(ObjectNotFound):  # an answer, not a failure
        proxied.stat("x/y")
    assert len(fault_proxy.log) == 1


def test_no_secrets_in_errors_logs_or_repr(
    gcs_bucket: str,
    fault_proxy: FaultProxy,
    fast_retry: RetryPolicy,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "ya29.super-secret-access-token"
    # A raw access token, sent as a bearer header; gcsfs would ask Google about its expiry.
    monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")
    backend = GCSBackend(
        f"gs://{gcs_bucket}/s", endpoint_url=fault_proxy.url, token=secret, part_size=PART, retry=fast_retry
    )
    caplog.set_level(logging.DEBUG)
    fault_proxy.inject(503, method="PUT", match=CHUNK, times=2)
    _write(backend, "a/b", os.urandom(2 * PART + 1))  # retries log warnings
    fault_proxy.inject(403, method="GET")
    with pytest.raises(StorageError) as info:
        backend.stat("a/b")
    upload_ids = {p.split("upload_id=")[1].split("&")[0] for _, p, _ in fault_proxy.log if "upload_id=" in p}
    assert upload_ids and f"Bearer {secret}" in fault_proxy.authorizations
    texts = [repr(backend), str(info.value), caplog.text]
    assert any("retrying" in t for t in texts)
    for text in texts:
        assert secret not in text
        assert not any(upload_id in text for upload_id in upload_ids)
