"""Issue 15's requests on GCS: a ranged read is one ranged GET (no metadata request first);
a batch delete is parallel DELETEs, each retried on its own; counted by the fault proxy."""

from __future__ import annotations

import pytest
from gcs_fault_proxy import FaultProxy

from tierstore.errors import StorageError
from tierstore_gcs import GCSBackend

DATA = bytes(range(256)) * 40


def test_open_range_is_one_ranged_get(proxied: GCSBackend, fault_proxy: FaultProxy) -> None:
    # What a range returns is the BackendContract's; here, what it costs.
    proxied.publish("obj", DATA)
    fault_proxy.log.clear()
    with proxied.open_range("obj", 1000, 3000) as stream:
        assert stream.read() == DATA[1000:4000]
    assert [m for m, _, _ in fault_proxy.log] == ["GET"]


def test_a_throttled_ranged_get_is_retried_whole(proxied: GCSBackend, fault_proxy: FaultProxy) -> None:
    proxied.publish("obj", DATA)
    fault_proxy.log.clear()
    fault_proxy.inject(503, method="GET", match="alt=media")
    with proxied.open_range("obj", 5, 100) as stream:
        assert stream.read() == DATA[5:105]
    assert [a for _, _, a in fault_proxy.log] == ["503", "forward"]


def test_delete_many_deletes_every_key_and_retries_each(proxied: GCSBackend, fault_proxy: FaultProxy) -> None:
    keys = [f"d/{i}" for i in range(20)]
    for key in keys:
        proxied.publish(key, b"x")
    proxied.publish("keep/x", b"x")
    fault_proxy.log.clear()
    fault_proxy.inject(503, method="DELETE")
    proxied.delete_many([*keys, "d/never-there"])
    assert [i.key for i in proxied.list("")] == ["keep/x"]
    deletes = [a for m, _, a in fault_proxy.log if m == "DELETE"]
    assert deletes.count("503") == 1 and deletes.count("forward") == len(keys) + 1


def test_a_refused_delete_names_its_key(proxied: GCSBackend, fault_proxy: FaultProxy) -> None:
    for key in ("r/1", "r/2"):
        proxied.publish(key, b"x")
    fault_proxy.inject(403, method="DELETE", match="r%2F2")
    with pytest.raises(StorageError) as caught:
        proxied.delete_many(["r/1", "r/2"])
    assert caught.value.key == "r/2"
    assert not proxied.exists("r/1") and proxied.exists("r/2")
