"""Issue 15's requests on S3: a ranged read is one ranged GET, a batch delete is one
DeleteObjects per 1,000 keys; counted on the wire by the fault proxy in front of moto."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from s3_fault_proxy import FaultProxy

import tierstore_s3._backend as s3_backend
from tierstore.errors import StorageError
from tierstore_s3 import S3Backend

DATA = bytes(range(256)) * 40


@pytest.fixture
def proxied(make_backend: Callable[..., S3Backend], fault_proxy: FaultProxy) -> S3Backend:
    return make_backend("batch", endpoint=fault_proxy.url)


def test_open_range_is_one_ranged_get(proxied: S3Backend, fault_proxy: FaultProxy) -> None:
    # What a range returns is the BackendContract's; here, what it costs.
    proxied.publish("obj", DATA)
    fault_proxy.reset()
    with proxied.open_range("obj", 1000, 3000) as stream:
        assert stream.read() == DATA[1000:4000]
    assert len(fault_proxy.seen()) == 1 and fault_proxy.seen("GET", "/batch/obj")


def test_a_throttled_ranged_get_is_retried_whole(proxied: S3Backend, fault_proxy: FaultProxy) -> None:
    proxied.publish("obj", DATA)
    fault_proxy.add("slowdown", method="GET", contains=("/batch/obj",))
    with proxied.open_range("obj", 5, 100) as stream:
        assert stream.read() == DATA[5:105]
    assert len(fault_proxy.seen("GET", "/batch/obj")) == 2


def test_delete_many_sends_one_request_per_batch(
    proxied: S3Backend, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_backend, "DELETE_BATCH", 10)  # 1,000 in production
    keys = [f"d/{i}" for i in range(25)]
    for key in keys:
        proxied.publish(key, b"x")
    proxied.publish("keep/x", b"x")
    fault_proxy.reset()
    proxied.delete_many([*keys, "d/never-there"])
    assert len(fault_proxy.seen("POST", "?delete")) == 3 and len(fault_proxy.seen()) == 3
    assert [i.key for i in proxied.list("")] == ["keep/x"]


def test_a_throttled_batch_is_sent_again(proxied: S3Backend, fault_proxy: FaultProxy) -> None:
    keys = [f"t/{i}" for i in range(4)]
    for key in keys:
        proxied.publish(key, b"x")
    fault_proxy.add("slowdown", method="POST", contains=("?delete",))
    proxied.delete_many(keys)
    assert list(proxied.list("t/")) == []


def test_a_refused_batch_names_a_key(proxied: S3Backend, fault_proxy: FaultProxy) -> None:
    proxied.publish("r/1", b"x")
    fault_proxy.add("deny", method="POST", contains=("?delete",))
    with pytest.raises(StorageError) as caught:
        proxied.delete_many(["r/1", "r/2"])
    assert caught.value.key == "r/1"
    assert proxied.exists("r/1")
