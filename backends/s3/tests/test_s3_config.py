"""Configuration (explicit, environment-only, invalid), credential hygiene, and the S3
specifics the contract suite cannot see: part boundaries, checksum kinds, aborts, listing."""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from s3_fault_proxy import FaultProxy
from s3_test_support import PART

from tierstore.errors import (
    ConfigError,
    ObjectNotFound,
    StorageError,
    TierstoreError,
    TransientStorageError,
)
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import crc32c_update
from tierstore.storage.registry import open_backend
from tierstore_s3 import S3Backend

MakeBackend = Callable[..., S3Backend]

KEY_ID = "AKIATIERSTORELEAKCHECK"
SECRET = "sEcReT-tierstore-must-never-leak-0xC0FFEE"
TOKEN = "ToKeN-tierstore-must-never-leak-0xBEEF"


def _write(backend: S3Backend, key: str, data: bytes) -> None:
    with backend.open_write(key) as out:
        out.write(data)


def _everything_said(err: BaseException) -> str:
    """An error as a user could ever see it: message, repr, and the whole chained traceback."""
    return "\n".join([str(err), repr(err), *traceback.format_exception(err)])


# -- credentials ------------------------------------------------------------------------------


def test_explicit_credentials_never_appear_in_repr_errors_or_logs(
    s3_bucket: str, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "aiobotocore", "s3fs", "tierstore", "tierstore_s3"):
        caplog.set_level(logging.DEBUG, logger=name)
    backend = S3Backend(
        f"s3://{s3_bucket}/creds",
        endpoint_url=fault_proxy.url,
        key=KEY_ID,
        secret=SECRET,
        token=TOKEN,
        region="us-west-2",
        part_size=PART,
        retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.001),
    )
    backend.publish("fine.json", b"{}")  # moto takes any credentials
    fault_proxy.add("deny", method="PUT", contains=("/creds/denied",))
    fault_proxy.add("slowdown", method="PUT", contains=("/creds/throttled",), times=5)
    failures: list[TierstoreError] = []
    for fail in (
        lambda: backend.stat("missing"),
        lambda: backend.publish("denied", b"x"),
        lambda: _write(backend, "throttled", b"x"),
        lambda: backend.publish("fine.json", b"{}"),
    ):
        with pytest.raises(TierstoreError) as info:
            fail()
        failures.append(info.value)
    assert [type(e) for e in failures][:3] == [ObjectNotFound, StorageError, TransientStorageError]
    errors = [_everything_said(e) for e in failures]
    assert any(r.name.startswith("botocore") for r in caplog.records)  # DEBUG was captured
    # The secret key never appears, not even in botocore's DEBUG request dumps.
    for text in [repr(backend), str(backend), caplog.text, *errors]:
        assert SECRET not in text
    # botocore's DEBUG dumps of signed requests show the session token and key id (its own
    # behaviour, outside our control); nothing else may: not repr, errors, tierstore's or
    # s3fs's logs, or any record at INFO and above.
    logged = [
        r.getMessage()
        for r in caplog.records
        if not r.name.startswith("botocore") or r.levelno >= logging.INFO
    ]
    for text in [repr(backend), str(backend), *errors, *logged]:
        assert TOKEN not in text and KEY_ID not in text


def test_environment_alone_configures_the_backend(
    monkeypatch: pytest.MonkeyPatch, s3_env: dict[str, str], s3_bucket: str
) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, os.devnull)  # nothing but the variables below
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    backend = open_backend(f"s3://{s3_bucket}/env-only", label="cold")  # the entry point
    assert isinstance(backend, S3Backend)
    data = os.urandom(70_000)
    _write(backend, "ck/data", data)
    backend.publish("manifests/ck.json", b"{}")
    assert backend.read_bytes("ck/data") == data
    assert {i.key for i in backend.list()} == {"ck/data", "manifests/ck.json"}
    assert backend.stat("ck/data").crc32c == crc32c_update(0, data)
    backend.delete("ck/data")
    assert not backend.exists("ck/data")
    backend.close()


@pytest.mark.parametrize(
    "url", ["s3://", "s3:///run", "s3://b/../x", "s3://b/a//c", "s3://b/run?versionId=1", "gs://b/run"]
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        S3Backend(url, endpoint_url="http://127.0.0.1:9", region="us-west-2")


@pytest.mark.parametrize(
    "options",
    [{"part_size": 1 << 20}, {"max_concurrency": 0}, {"no_such_option": 1}, {"profile": "no-such-profile"}],
)
def test_bad_options_are_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        S3Backend("s3://bucket/run", endpoint_url="http://127.0.0.1:9", region="us-west-2", **options)


# -- uploads --------------------------------------------------------------------------------


@pytest.mark.parametrize("size, parts", [(0, 0), (PART - 1, 0), (PART, 0), (PART + 1, 2)])
def test_single_put_below_part_size_multipart_above(
    make_backend: MakeBackend, fault_proxy: FaultProxy, size: int, parts: int
) -> None:
    backend = make_backend("sizes", endpoint=fault_proxy.url)
    data = os.urandom(size)
    _write(backend, "obj", data)
    uploads = fault_proxy.seen("POST", "?uploads")
    assert len(uploads) == (1 if parts else 0)
    assert len(fault_proxy.seen("PUT", "partNumber=")) == parts
    assert backend.read_bytes("obj") == data
    assert backend.stat("obj").crc32c == crc32c_update(0, data)


@pytest.mark.parametrize("full_object", [True, False])
def test_multipart_checksum_kinds(make_backend: MakeBackend, full_object: bool) -> None:
    backend = make_backend("kinds", full_object_checksum=full_object)
    data = os.urandom(PART + 4321)
    _write(backend, "obj", data)  # close() verified it either way
    # A composite checksum is a checksum of checksums: not the bytes' CRC32C.
    expected = crc32c_update(0, data) if full_object else None
    assert backend.stat("obj").crc32c == expected


def test_abort_removes_the_upload_and_leaves_no_object(
    make_backend: MakeBackend, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("abort")
    with pytest.raises(RuntimeError):
        with backend.open_write("big") as out:
            out.write(os.urandom(2 * PART + 10))  # two parts on their way
            raise RuntimeError("writer died")
    out = backend.open_write("other")
    out.write(os.urandom(PART + 1))
    out.abort()
    assert not boto_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    assert list(backend.list()) == []


def test_abort_stale_uploads_finds_and_aborts_only_old_uploads_below_the_root(
    make_backend: MakeBackend, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("gc")
    for key in ("gc/ck/killed-writer", "elsewhere/not-ours"):  # as a SIGKILLed writer leaves
        boto_client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    # moto reports one fixed Initiated time for every upload: age them from that.
    uploads = boto_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    started = uploads[0]["Initiated"].timestamp()
    young, old = started + 30, started + 120
    assert backend.abort_stale_uploads(older_than=60, now=young, dry_run=False) == []
    assert backend.abort_stale_uploads(older_than=60, now=old) == ["ck/killed-writer"]
    assert len(boto_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]) == 2  # dry run
    assert backend.abort_stale_uploads(older_than=60, now=old, dry_run=False) == ["ck/killed-writer"]
    left = boto_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert [u["Key"] for u in left] == ["elsewhere/not-ours"]


# -- listing --------------------------------------------------------------------------------


def test_list_pages_and_stays_inside_the_prefix(
    make_backend: MakeBackend, fault_proxy: FaultProxy, boto_client: Any, s3_bucket: str
) -> None:
    backend = make_backend("run", endpoint=fault_proxy.url)
    keys = {f"ck/{i}" for i in range(5)} | {"ck/sub/deep", "manifests/a.json"}
    for key in keys:
        backend.publish(key, key.encode())
    for outside in ("runner/x", "other/run/y", "run/dir-marker/"):
        boto_client.put_object(Bucket=s3_bucket, Key=outside, Body=b"")
    fault_proxy.add("small_pages", method="GET", contains=("list-type=2",), times=100)
    infos = {i.key: i for i in backend.list()}
    assert set(infos) == keys
    assert infos["ck/sub/deep"].size == len(b"ck/sub/deep")
    assert len(fault_proxy.seen("GET", "list-type=2")) == 4  # 7 keys + a marker, 2 a page
    assert {i.key for i in backend.list("ck/")} == {k for k in keys if k.startswith("ck/")}


def _open_connections_to(port: int) -> int:
    """This process's established TCP connections to ``port`` on 127.0.0.1 (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    inodes.add(f"socket:[{fields[9]}]")
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") in inodes
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="counts connections through /proc")
def test_close_releases_connections_and_is_idempotent(make_backend: MakeBackend, s3_endpoint: str) -> None:
    # A proxy of its own: the session's proxy port also carries other tests' connections.
    proxy = FaultProxy(s3_endpoint)
    try:
        port = int(proxy.url.rsplit(":", 1)[1])  # a keep-alive server: connections stay open
        backend = make_backend("closing", endpoint=proxy.url)
        backend.publish("x", b"x")
        assert _open_connections_to(port) >= 1
        backend.close()
        assert _open_connections_to(port) == 0
        backend.close()  # a second close is a no-op, not an error
        assert _open_connections_to(port) == 0
    finally:
        proxy.close()
