"""``S3Backend``: a tier in an S3 bucket (or any S3-compatible store) through s3fs.

Why one module of about 480 lines: it is the backend contract's every operation mapped to S3
(conditional writes and deletes, versions as ETags, full-object CRC32C); the writer and the
reader are their own modules.
"""

from __future__ import annotations

import builtins
import io
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlparse

import s3fs
from botocore.exceptions import BotoCoreError
from fsspec.asyn import sync

from tierstore.errors import (
    ConfigError,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    StorageError,
    TransientStorageError,
    UnsafePath,
)
from tierstore.retry import DEFAULT, RetryPolicy
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key, crc32c_update
from tierstore_s3 import _checksum
from tierstore_s3._errors import _TRANSIENT_CODES, client_error_code, translate
from tierstore_s3._reader import open_ranged
from tierstore_s3._writer import S3ObjectWriter

__all__ = ["S3Backend"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
# tierstore.retry is the one retry policy (docs/design.md, Conventions): botocore and s3fs must not retry
# underneath it, or a conditional PUT could be resent without us knowing (design.md invariant 12).
_NO_CLIENT_RETRIES = {"mode": "standard", "total_max_attempts": 1}
_PUBLISH_TOKEN = "tierstore-publish"  # user metadata (x-amz-meta-*) set by publish
DELETE_BATCH = 1000  # S3's limit of keys per DeleteObjects request
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the client to close its connections


def _split_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if "@" in parsed.netloc:  # never echo it: the part before "@" may be a secret
        raise ConfigError(
            "credentials do not belong in an S3 tier URL: pass key=/secret= or use the AWS credential chain"
        )
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise ConfigError(f"not an S3 tier URL (s3://bucket[/prefix]): {url!r}")
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except UnsafePath as err:
            raise ConfigError(f"unsafe prefix in S3 tier URL {url!r}") from err
    return parsed.netloc, prefix


def _make_fs(
    endpoint_url: str | None,
    key: str | None,
    secret: str | None,
    token: str | None,
    profile: str | None,
    region: str | None,
    extra: Mapping[str, Any],
) -> s3fs.S3FileSystem:
    """An s3fs filesystem: explicit settings where given, else the standard AWS chain."""
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    options.update(extra)
    explicit = {
        "endpoint_url": endpoint_url,
        "key": key,
        "secret": secret,
        "token": token,
        "profile": profile,
    }
    options.update({name: value for name, value in explicit.items() if value is not None})
    if region is not None:
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "region_name": region}
    options["config_kwargs"] = {**options.get("config_kwargs", {}), "retries": _NO_CLIENT_RETRIES}
    fs = s3fs.S3FileSystem(**options)
    fs.retries = 1  # s3fs's own retry loop: one attempt
    # Build the client now, not inside the first write: a bad profile or region fails
    # here, and a stream's memory is not charged with loading botocore's models.
    fs.connect()
    _require_parameters(fs)
    return fs


# s3fs silently drops request parameters its botocore does not know: an old botocore would
# turn the exclusive publish into a plain overwrite. Refuse to run on one.
_REQUIRED = {
    "PutObject": ("IfNoneMatch", "ChecksumCRC32C"),
    "CreateMultipartUpload": ("ChecksumType",),
    "CompleteMultipartUpload": ("ChecksumType", "ChecksumCRC32C"),
}


def _require_parameters(fs: s3fs.S3FileSystem) -> None:
    model = fs.s3.meta.service_model
    for operation, names in _REQUIRED.items():
        known = model.operation_model(operation).input_shape.members
        missing = [name for name in names if name not in known]
        if missing:
            raise ConfigError(
                f"this botocore's S3 {operation} lacks {missing}: upgrade "
                "s3fs/aiobotocore to a 2025 or later botocore"
            )


class S3Backend(Backend):
    """Objects under ``s3://bucket[/prefix]``; keys are relative to the prefix.

    Writes stream: below ``part_size`` one PutObject, else a multipart upload with at most
    ``max_concurrency`` parts in flight, so a write holds about
    ``part_size * (max_concurrency + 1)`` bytes whatever the object's size (and at most
    10,000 parts: 156 GiB at 16 MiB). Every upload carries a client-side CRC32C that S3
    verifies; ``close()`` then checks the stored size and CRC32C. A multipart write resumes
    the pending upload that an interrupted write of its key left, reusing a stored part only
    where it holds the same bytes (:mod:`tierstore_s3._resume`). ``publish`` is one
    PutObject with ``If-None-Match: *`` whose user metadata names the call, so that a 412
    after a lost answer is told apart: our own object (success) or a rival's (conflict).
    Retries are :mod:`tierstore.retry`'s alone; botocore's and s3fs's are switched off.

    Options: ``endpoint_url``, ``key``, ``secret``, ``token``, ``profile``, ``region``
    (without them the standard AWS chain applies: environment, including
    ``AWS_ENDPOINT_URL``, profile, instance role); ``part_size`` (16 MiB, at least 5 MiB);
    ``max_concurrency`` (4); ``full_object_checksum`` (ask S3 to verify and keep one CRC32C
    of a whole multipart object; turn off for S3-compatible stores without FULL_OBJECT
    checksums); ``retry`` (a :class:`~tierstore.retry.RetryPolicy`); ``s3fs_options``
    (passed to ``s3fs.S3FileSystem``).
    """

    scheme = "s3"
    spread_keys = True  # data keys over hashed prefixes: S3 throttles per prefix

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        profile: str | None = None,
        region: str | None = None,
        part_size: int = 16 * MiB,
        max_concurrency: int = 4,
        full_object_checksum: bool = True,
        retry: RetryPolicy = DEFAULT,
        s3fs_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url)
        if options:
            raise ConfigError(f"unknown options for an S3 tier: {sorted(options)}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ConfigError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.bucket, self.prefix = _split_url(url)
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.full_object_checksum = full_object_checksum
        self.retry = retry
        self._closed = False
        try:
            self._fs = _make_fs(endpoint_url, key, secret, token, profile, region, dict(s3fs_options or {}))
        except ConfigError:
            raise
        except (TypeError, ValueError, BotoCoreError) as err:
            raise ConfigError(f"cannot set up S3 tier {url!r}: {type(err).__name__}: {err}") from err

    # -- plumbing shared with the writer and reader -------------------------------------

    def full_key(self, key: str) -> str:
        check_key(key, tier=self.label)
        return f"{self.prefix}/{key}" if self.prefix else key

    def call(self, method: str, key: str, **params: Any) -> Any:
        """One S3 request about ``key``; failures come out as tierstore errors."""
        try:
            return self._fs.call_s3(method, Bucket=self.bucket, **params)
        except Exception as err:
            failure = translate(err, key=key, tier=self.label)
            if failure is err:
                raise
            raise failure from err

    def retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run the idempotent unit ``fn`` under the retry policy."""
        return self.retry.call(fn, what=f"S3 {what} of {key!r} in {self.label}")

    @property
    def fs(self) -> s3fs.S3FileSystem:
        return self._fs

    def head(self, key: str) -> dict[str, Any]:
        full = self.full_key(key)
        answer: dict[str, Any] = self.retrying(
            "head", key, lambda: self.call("head_object", key, Key=full, ChecksumMode="ENABLED")
        )
        return answer

    def put(self, key: str, body: bytes | BinaryIO, crc: int, **conditions: Any) -> Any:
        """One PutObject (not retried here) carrying our CRC32C for S3 to check."""
        return self.call(
            "put_object",
            key,
            Key=self.full_key(key),
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=_checksum.encode(crc),
            **conditions,
        )

    # -- the contract -------------------------------------------------------------------

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self.full_key(key)
        return S3ObjectWriter(key, self)

    def open_read(self, key: str) -> BinaryIO:
        return open_ranged(self, key, self.head(key))

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """One ranged GetObject, fetched whole before any byte is handed out (one retried
        unit, never a stream resumed halfway)."""
        full = self.full_key(key)
        if length <= 0:
            self.head(key)  # still: a missing key is ObjectNotFound
            return io.BytesIO(b"")
        data = self.retrying(
            f"read of bytes {offset}-{offset + length - 1}",
            key,
            lambda: self._get_range(key, full, offset, length),
        )
        return io.BytesIO(data)

    def read_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """One GetObject, of the first ``limit`` + 1 bytes with a limit: one version read
        whole, with no HeadObject before it. A head, then a GET pinned to the ETag it saw,
        let a delete in between turn "no such object" (what a caller acts on: a mark or
        manifest removed since it was listed) into a read error; one GET reads either the
        object as it is or nothing."""
        full = self.full_key(key)
        wanted = None if limit is None else limit + 1
        data = self.retrying("read", key, lambda: self._get_range(key, full, 0, wanted))
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"object larger than {limit} bytes", key=key, tier=self.label)
        return data

    def _get_range(self, key: str, full: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes from ``offset`` (``None``: the whole object, no range asked)."""
        try:
            return bytes(sync(self._fs.loop, self._fetch_range, key, full, offset, length))
        except Exception as err:
            if client_error_code(err) == "InvalidRange":  # 416: the range starts past the end
                return b""
            failure = translate(err, key=key, tier=self.label)
            if failure is err:
                raise
            raise failure from err

    async def _fetch_range(self, key: str, full: str, offset: int, length: int | None) -> bytes:
        ranged = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}
        answer = await self._fs._call_s3("get_object", Bucket=self.bucket, Key=full, **ranged)
        async with answer["Body"] as body:
            data: bytes = await body.read()
        if length is None and answer.get("ContentLength") not in (None, len(data)):
            raise TransientStorageError(
                f"read: got {len(data)} of {answer['ContentLength']} bytes", key=key, tier=self.label
            )
        # "bytes <first>-<last>/<size>": the server's word on how many bytes it meant to send
        sent = str(answer.get("ContentRange") or "")
        first, _, last = sent.partition(" ")[2].partition("/")[0].partition("-")
        if first.isdigit() and last.isdigit() and len(data) != int(last) - int(first) + 1:
            raise TransientStorageError(
                f"range {sent} came back with {len(data)} bytes", key=key, tier=self.label
            )
        return data

    def publish(self, key: str, data: bytes) -> None:
        data = bytes(data)
        crc = crc32c_update(0, data)
        token = uuid.uuid4().hex  # names this call's PUT, so a read-back can recognise it

        def attempt() -> None:
            try:
                self.put(key, data, crc, IfNoneMatch="*", Metadata={_PUBLISH_TOKEN: token})
            except PublishConflict:
                # The 412 may answer a resend of our own PUT whose first answer was lost:
                # our retry, or aiohttp's silent resend of a PUT on a dropped keep-alive
                # connection. Read back and compare before deciding (design.md invariant 12).
                if not self._published_by(key, token, len(data), crc):
                    raise
                log.info("publish of %s in %s: an earlier send had landed", key, self.label)

        self.retrying("publish", key, attempt)

    def _published_by(self, key: str, token: str, size: int, crc: int) -> bool:
        """Whether ``key`` holds the object that the publish named ``token`` sent.

        The token tells our object from a rival's, even one with identical bytes (of two
        racing publishers exactly one wins); size and CRC32C confirm its bytes.
        """
        try:
            head = self.head(key)
        except ObjectNotFound as err:  # removed since the 412: the publish may go ahead
            raise TransientStorageError(
                "object vanished after a conflicting publish", key=key, tier=self.label
            ) from err
        stored_crc = _checksum.full_object_crc32c(head)
        ours = (head.get("Metadata") or {}).get(_PUBLISH_TOKEN) == token
        return bool(ours and int(head["ContentLength"]) == size and stored_crc in (None, crc))

    def stat(self, key: str) -> ObjectInfo:
        head = self.head(key)
        return _info(key, int(head["ContentLength"]), head, crc32c=_checksum.full_object_crc32c(head))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        root = f"{self.prefix}/" if self.prefix else ""
        start = f"{self.full_key(prefix.rstrip('/'))}/" if prefix else root
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Prefix": start}
            if token:
                params["ContinuationToken"] = token
            page = self.retrying("list", prefix, partial(self.call, "list_objects_v2", prefix, **params))
            yield from self._page_infos(page, root)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _page_infos(self, page: Mapping[str, Any], root: str) -> Iterator[ObjectInfo]:
        for obj in page.get("Contents", []):
            rel = str(obj["Key"])[len(root) :]
            try:
                check_key(rel)
            except UnsafePath:  # "dir/" markers and keys no tierstore key can name
                log.debug("list of %s skips key %r", self.label, obj["Key"])
                continue
            yield _info(rel, int(obj["Size"]), obj)

    def delete(self, key: str) -> None:
        full = self.full_key(key)
        try:
            self.retrying("delete", key, lambda: self.call("delete_object", key, Key=full))
        except ObjectNotFound:
            pass

    def delete_if(self, key: str, version: str) -> bool:
        """One DeleteObject with ``If-Match`` the ETag: S3 itself compares (412: another
        object). A store that ignores ``If-Match`` deletes unconditionally."""
        full = self.full_key(key)
        try:
            self.retrying(
                "conditional delete",
                key,
                lambda: self.call("delete_object", key, Key=full, IfMatch=f'"{version}"'),
            )
        except ObjectNotFound:
            return True
        except PublishConflict:  # the 412 of If-Match
            return False
        return True

    def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects, up to 1,000 keys a request, each request one retried unit (deleting
        again is harmless). A key S3 could not delete raises the error naming it."""
        batch: builtins.list[str] = []
        for key in keys:
            self.full_key(key)  # reject an unsafe key before any request
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: builtins.list[str]) -> None:
        by_full = {self.full_key(key): key for key in keys}

        def attempt() -> None:
            answer = self.call(
                "delete_objects",
                keys[0],
                Delete={"Objects": [{"Key": full} for full in by_full], "Quiet": True},
            )
            errors = answer.get("Errors") or []
            if not errors:
                return
            first = errors[0]
            key = by_full.get(str(first.get("Key")), str(first.get("Key")))
            text = (
                f"S3 DeleteObjects could not delete {len(errors)} of {len(keys)} keys; "
                f"this one: {first.get('Code')}: {first.get('Message', '')}"
            )
            if all(e.get("Code") in _TRANSIENT_CODES for e in errors):
                raise TransientStorageError(text, key=key, tier=self.label)
            raise StorageError(text, key=key, tier=self.label)

        self.retrying(f"batch delete ({len(keys)} keys, from)", keys[0], attempt)

    def abort_stale_uploads(
        self, *, older_than: float, dry_run: bool = True, now: float | None = None
    ) -> builtins.list[str]:
        """Abort multipart uploads below this tier's root started ``older_than`` seconds
        ago or earlier (a writer killed mid-upload leaves one); return their keys."""
        now = time.time() if now is None else now
        stale = [
            (key, upload_id)
            for key, upload_id, started in self._open_uploads()
            if now - started >= older_than
        ]
        if stale and not dry_run:
            for key, upload_id in stale:
                self.abort_upload(key, upload_id)
            log.info("aborted %d stale multipart uploads in %s", len(stale), self.label)
        return [key for key, _ in stale]

    def _open_uploads(self) -> Iterator[tuple[str, str, float]]:
        root = f"{self.prefix}/" if self.prefix else ""
        markers: dict[str, str] = {}
        while True:
            params = {"Prefix": root, **markers}
            page = self.retrying(
                "list uploads", "", partial(self.call, "list_multipart_uploads", "", **params)
            )
            for upload in page.get("Uploads", []):
                started = upload["Initiated"].timestamp()
                yield str(upload["Key"])[len(root) :], upload["UploadId"], started
            if not page.get("IsTruncated"):
                return
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; one already gone counts as aborted."""
        full = f"{self.prefix}/{key}" if self.prefix else key
        try:
            self.retrying(
                "abort multipart upload",
                key,
                lambda: self.call("abort_multipart_upload", key, Key=full, UploadId=upload_id),
            )
        except StorageError as err:
            if client_error_code(err) != "NoSuchUpload":  # gone already: fine
                raise

    def close(self) -> None:
        """Close the client and its connections before returning. s3fs's own close gives the
        client 0.1 s, then closes the connector from this thread, which only schedules each
        socket's close on the event loop: on a loaded machine a connection outlived
        ``close()``. Waited here up to :data:`CLOSE_TIMEOUT` seconds; s3fs's path after that."""
        creator = getattr(self._fs, "_s3creator", None)
        if creator is None or self._closed:
            return
        self._closed = True
        loop = self._fs.loop
        if loop is not None and loop.is_running():
            try:
                sync(loop, creator.__aexit__, None, None, None, timeout=CLOSE_TIMEOUT)
                return
            except Exception as err:  # a timeout, or a client already broken
                log.debug("closing the S3 client of %s: %s", self.label, err)
        s3fs.S3FileSystem.close_session(loop, creator)


def _info(key: str, size: int, described: Mapping[str, Any], *, crc32c: int | None = None) -> ObjectInfo:
    """An object as a HEAD or a listing entry (``described``) tells of it."""
    modified = described.get("LastModified")
    return ObjectInfo(
        key=key,
        size=size,
        mtime=modified.timestamp() if modified is not None else None,
        crc32c=crc32c,
        version=_checksum.etag(described),
    )
