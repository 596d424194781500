"""Failures on the wire, injected by a proxy in front of moto: transient ones are retried
through tierstore.retry and the operation succeeds; permanent ones fail once and clearly;
an ambiguous conditional publish reads back before deciding (docs/design.md invariant 12)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from s3_fault_proxy import FaultProxy
from s3_test_support import PART

from tierstore.errors import ChecksumMismatch, PublishConflict, StorageError, TransientStorageError
from tierstore.storage.backend import crc32c_update
from tierstore_s3 import S3Backend

MakeBackend = Callable[..., S3Backend]


@pytest.fixture
def flaky(make_backend: MakeBackend, fault_proxy: FaultProxy) -> S3Backend:
    """A backend whose every request goes through the fault proxy."""
    return make_backend("faults", endpoint=fault_proxy.url)


def _write(backend: S3Backend, key: str, data: bytes) -> None:
    with backend.open_write(key) as out:
        for start in range(0, len(data), 1 << 20):
            out.write(data[start : start + (1 << 20)])


def _actions(proxy: FaultProxy, method: str, contains: str) -> list[str]:
    return [seen.action for seen in proxy.seen(method, contains)]


def _no_open_uploads(client: Any, bucket: str) -> bool:
    return not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


# -- transient failures are retried ------------------------------------------------------


def test_single_put_survives_slowdown_and_reset(flaky: S3Backend, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("slowdown", method="PUT", contains=("/faults/one",))
    fault_proxy.add("reset", method="PUT", contains=("/faults/one",))
    data = os.urandom(300_000)
    _write(flaky, "one", data)
    assert _actions(fault_proxy, "PUT", "/faults/one") == ["slowdown", "reset", "forward"]
    assert flaky.read_bytes("one") == data
    assert flaky.stat("one").crc32c == crc32c_update(0, data)


def test_multipart_survives_faults_at_every_step(
    flaky: S3Backend, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    fault_proxy.add("slowdown", method="POST", contains=("/faults/big", "?uploads"))
    fault_proxy.add("reset", method="PUT", contains=("&partNumber=2",))
    fault_proxy.add("internal", method="PUT", contains=("&partNumber=3",))
    # The completion takes effect but its answer is lost: the retry finds no upload, and
    # the size + CRC32C check after it proves the object complete.
    fault_proxy.add("lose_answer", method="POST", contains=("/faults/big", "uploadId="))
    data = os.urandom(2 * PART + 12_345)
    _write(flaky, "big", data)
    assert _actions(fault_proxy, "POST", "?uploads") == ["slowdown", "forward"]
    assert _actions(fault_proxy, "PUT", "&partNumber=2") == ["reset", "forward"]
    assert _actions(fault_proxy, "PUT", "&partNumber=3") == ["internal", "forward"]
    completions = fault_proxy.seen("POST", "uploadId=")
    assert [s.action for s in completions] == ["lose_answer", "forward"]
    # moto answers a repeated completion 200, S3 may answer 404 NoSuchUpload: both are fine.
    assert completions[1].status in (200, 404)
    assert flaky.read_bytes("big") == data
    assert flaky.stat("big").crc32c == crc32c_update(0, data)  # FULL_OBJECT checksum
    assert _no_open_uploads(boto_client, s3_bucket)


def test_parts_in_flight_are_bounded_by_max_concurrency(flaky: S3Backend, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("delay", method="PUT", contains=("partNumber=",), times=100, delay=0.15)
    data = os.urandom(3 * PART + 1)  # 4 parts, max_concurrency 2
    _write(flaky, "wide", data)
    assert len(fault_proxy.seen("PUT", "partNumber=")) == 4
    assert fault_proxy.peak_in_flight("part") == flaky.max_concurrency == 2
    assert flaky.read_bytes("wide") == data


@pytest.mark.parametrize("fault", ["slowdown", "internal", "conflict", "timeout", "bad_digest", "reset"])
def test_publish_retries_transient_failures(flaky: S3Backend, fault_proxy: FaultProxy, fault: str) -> None:
    fault_proxy.add(fault, method="PUT", contains=("/faults/m/a.json",), times=2)
    flaky.publish("m/a.json", b'{"ok": 1}')
    assert _actions(fault_proxy, "PUT", "/faults/m/a.json") == [fault, fault, "forward"]
    assert flaky.read_bytes("m/a.json") == b'{"ok": 1}'


def test_reads_retry_whole_ranges(
    make_backend: MakeBackend, flaky: S3Backend, fault_proxy: FaultProxy
) -> None:
    data = os.urandom(2 * PART + 99)
    _write(make_backend("faults"), "r", data)  # written directly, read through the proxy
    fault_proxy.add("slowdown", method="GET", contains=("/faults/r",))
    fault_proxy.add("reset", method="GET", contains=("/faults/r",), times=2)
    with flaky.open_read("r") as stream:
        assert stream.read() == data
    assert _actions(fault_proxy, "GET", "/faults/r").count("forward") == 3  # one per range


# -- permanent failures are not ------------------------------------------------------------


@pytest.mark.parametrize("op", ["publish", "write", "multipart"])
def test_access_denied_is_permanent_names_key_and_tier(
    flaky: S3Backend, fault_proxy: FaultProxy, op: str
) -> None:
    flaky.label = "cold s3://bucket/faults"
    fault_proxy.add("deny", method="PUT", contains=("/faults/ck/x",), times=100)
    with pytest.raises(StorageError) as info:
        if op == "publish":
            flaky.publish("ck/x", b"data")
        else:
            _write(flaky, "ck/x", os.urandom(PART + 1 if op == "multipart" else 10))
    err = info.value
    assert not isinstance(err, TransientStorageError)
    assert (err.key, err.tier) == ("ck/x", flaky.label)
    text = str(err)
    assert "ck/x" in text and flaky.label in text and "AccessDenied" in text
    assert "permanent" in text
    paths = [seen.path for seen in fault_proxy.seen("PUT", "/faults/ck/x")]
    assert paths and len(paths) == len(set(paths))  # no request was sent twice
    assert not flaky.exists("ck/x")


def test_stored_checksum_differs_is_checksum_mismatch(flaky: S3Backend, fault_proxy: FaultProxy) -> None:
    # moto stores whatever checksum it is sent without checking it: a wrong one stands in
    # for a server that holds other bytes than we sent.
    fault_proxy.add("wrong_checksum", method="PUT", contains=("/faults/bad",))
    with pytest.raises(ChecksumMismatch) as info:
        _write(flaky, "bad", os.urandom(1000))
    assert info.value.key == "bad" and "CRC32C" in str(info.value)
    assert not flaky.exists("bad")  # the bad object is deleted


def test_stored_size_differs_is_checksum_mismatch(flaky: S3Backend, fault_proxy: FaultProxy) -> None:
    fault_proxy.add("truncate", method="PUT", contains=("/faults/short",))
    with pytest.raises(ChecksumMismatch) as info:
        _write(flaky, "short", os.urandom(1000))
    assert "size" in str(info.value) and info.value.tier == flaky.label
    assert not flaky.exists("short")


# -- ambiguous conditional publish (design.md invariant 12) ----------------------------------


def test_lost_answer_then_412_for_our_own_put_is_success(flaky: S3Backend, fault_proxy: FaultProxy) -> None:
    # The first conditional PUT lands, its answer is lost; the resend (ours, or aiohttp's
    # own on a reused connection) gets 412; the read-back shows the object is ours.
    fault_proxy.add("lose_answer", method="PUT", contains=("/faults/manifests/a.json",))
    flaky.publish("manifests/a.json", b'{"attempt": "ours"}')  # no error
    puts = fault_proxy.seen("PUT", "/faults/manifests/a.json")
    assert [(s.action, s.status) for s in puts] == [("lose_answer", 200), ("forward", 412)]
    assert fault_proxy.seen("HEAD", "/faults/manifests/a.json")  # it read back
    assert flaky.read_bytes("manifests/a.json") == b'{"attempt": "ours"}'


@pytest.mark.parametrize("theirs", [b'{"attempt": "theirs"}', b'{"attempt": "ours"}'])
def test_412_after_a_lost_put_with_a_rivals_object_is_conflict(
    make_backend: MakeBackend, flaky: S3Backend, fault_proxy: FaultProxy, theirs: bytes
) -> None:
    rival = make_backend("faults")

    def rival_wins() -> None:
        rival.publish("manifests/b.json", theirs)

    # Our first PUT never arrives; meanwhile a rival publishes (even the very same bytes:
    # of two publishers exactly one wins); our resend gets 412 and the read-back says
    # the object is not ours.
    fault_proxy.add("reset", method="PUT", contains=("/faults/manifests/b.json",), before=rival_wins)
    with pytest.raises(PublishConflict) as info:
        flaky.publish("manifests/b.json", b'{"attempt": "ours"}')
    assert info.value.key == "manifests/b.json"
    assert flaky.read_bytes("manifests/b.json") == theirs


def test_publishing_the_same_bytes_twice_is_a_conflict(flaky: S3Backend) -> None:
    flaky.publish("manifests/c.json", b"first")
    with pytest.raises(PublishConflict):
        flaky.publish("manifests/c.json", b"first")
