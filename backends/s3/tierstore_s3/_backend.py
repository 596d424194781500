"""``S3Backend``: a tier in an S3 bucket (or any S3-compatible store) through s3fs.

The backend contract's every operation mapped to S3 (conditional writes and deletes, versions
as ETags, full-object CRC32C); the requests themselves go through :mod:`tierstore_s3._client`,
which the writer and the reader, modules of their own, use too.
"""

from __future__ import annotations

import builtins
import io
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any, BinaryIO

import s3fs
from botocore.exceptions import BotoCoreError
from fsspec.asyn import sync

from tierstore._redact import redact_url
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
from tierstore_s3._client import S3Client, make_fs, split_url
from tierstore_s3._errors import _TRANSIENT_CODES, client_error_code, translate
from tierstore_s3._reader import open_ranged
from tierstore_s3._writer import S3ObjectWriter

__all__ = ["S3Backend"]

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
_PUBLISH_TOKEN = "tierstore-publish"  # user metadata (x-amz-meta-*) set by publish
DELETE_BATCH = 1000  # S3's limit of keys per DeleteObjects request
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the client to close its connections


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
        if options:
            raise ConfigError(f"unknown options for an S3 tier: {sorted(options)}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ConfigError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        bucket, prefix = split_url(url)
        try:
            fs = make_fs(endpoint_url, key, secret, token, profile, region, dict(s3fs_options or {}))
        except ConfigError:
            raise
        except (TypeError, ValueError, BotoCoreError) as err:
            raise ConfigError(f"cannot set up S3 tier {url!r}: {type(err).__name__}: {err}") from err
        self.client = S3Client(
            fs,
            bucket,
            prefix,
            redact_url(url),
            part_size=part_size,
            max_concurrency=max_concurrency,
            full_object_checksum=full_object_checksum,
            retry=retry,
        )
        super().__init__(url)  # after the client: it holds the label
        self._closed = False

    # The settings, as the client holds them.

    @property
    def label(self) -> str:
        return self.client.label

    @label.setter
    def label(self, label: str) -> None:  # the registry names the tier ("hot s3://...")
        self.client.label = label

    @property
    def fs(self) -> s3fs.S3FileSystem:
        return self.client.fs

    @property
    def bucket(self) -> str:
        return self.client.bucket

    @property
    def prefix(self) -> str:
        return self.client.prefix

    @property
    def part_size(self) -> int:
        return self.client.part_size

    @property
    def max_concurrency(self) -> int:
        return self.client.max_concurrency

    @property
    def full_object_checksum(self) -> bool:
        return self.client.full_object_checksum

    @property
    def retry(self) -> RetryPolicy:
        return self.client.retry

    # -- the contract -------------------------------------------------------------------

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self.client.full_key(key)
        return S3ObjectWriter(key, self.client)

    def open_read(self, key: str) -> BinaryIO:
        return open_ranged(self.client, key, self.client.head(key))

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """One ranged GetObject, fetched whole before any byte is handed out (one retried
        unit, never a stream resumed halfway)."""
        full = self.client.full_key(key)
        if length <= 0:
            self.client.head(key)  # still: a missing key is ObjectNotFound
            return io.BytesIO(b"")
        data = self.client.retrying(
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
        full = self.client.full_key(key)
        wanted = None if limit is None else limit + 1
        data = self.client.retrying("read", key, lambda: self._get_range(key, full, 0, wanted))
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"object larger than {limit} bytes", key=key, tier=self.label)
        return data

    def _get_range(self, key: str, full: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes from ``offset`` (``None``: the whole object, no range asked)."""
        try:
            return bytes(sync(self.client.fs.loop, self._fetch_range, key, full, offset, length))
        except Exception as err:
            if client_error_code(err) == "InvalidRange":  # 416: the range starts past the end
                return b""
            failure = translate(err, key=key, tier=self.label)
            if failure is err:
                raise
            raise failure from err

    async def _fetch_range(self, key: str, full: str, offset: int, length: int | None) -> bytes:
        ranged = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}
        answer = await self.client.fs._call_s3("get_object", Bucket=self.bucket, Key=full, **ranged)
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
                self.client.put(key, data, crc, IfNoneMatch="*", Metadata={_PUBLISH_TOKEN: token})
            except PublishConflict:
                # The 412 may answer a resend of our own PUT whose first answer was lost:
                # our retry, or aiohttp's silent resend of a PUT on a dropped keep-alive
                # connection. Read back and compare before deciding (design.md invariant 12).
                if not self._published_by(key, token, len(data), crc):
                    raise
                log.info("publish of %s in %s: an earlier send had landed", key, self.label)

        self.client.retrying("publish", key, attempt)

    def _published_by(self, key: str, token: str, size: int, crc: int) -> bool:
        """Whether ``key`` holds the object that the publish named ``token`` sent.

        The token tells our object from a rival's, even one with identical bytes (of two
        racing publishers exactly one wins); size and CRC32C confirm its bytes.
        """
        try:
            head = self.client.head(key)
        except ObjectNotFound as err:  # removed since the 412: the publish may go ahead
            raise TransientStorageError(
                "object vanished after a conflicting publish", key=key, tier=self.label
            ) from err
        stored_crc = _checksum.full_object_crc32c(head)
        ours = (head.get("Metadata") or {}).get(_PUBLISH_TOKEN) == token
        return bool(ours and int(head["ContentLength"]) == size and stored_crc in (None, crc))

    def stat(self, key: str) -> ObjectInfo:
        head = self.client.head(key)
        return _info(key, int(head["ContentLength"]), head, crc32c=_checksum.full_object_crc32c(head))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        root = f"{self.prefix}/" if self.prefix else ""
        start = f"{self.client.full_key(prefix.rstrip('/'))}/" if prefix else root
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Prefix": start}
            if token:
                params["ContinuationToken"] = token
            page = self.client.retrying(
                "list", prefix, partial(self.client.call, "list_objects_v2", prefix, **params)
            )
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
        full = self.client.full_key(key)
        try:
            self.client.retrying("delete", key, lambda: self.client.call("delete_object", key, Key=full))
        except ObjectNotFound:
            pass

    def delete_if(self, key: str, version: str) -> bool:
        """One DeleteObject with ``If-Match`` the ETag: S3 itself compares (412: another
        object). A store that ignores ``If-Match`` deletes unconditionally."""
        full = self.client.full_key(key)
        try:
            self.client.retrying(
                "conditional delete",
                key,
                lambda: self.client.call("delete_object", key, Key=full, IfMatch=f'"{version}"'),
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
            self.client.full_key(key)  # reject an unsafe key before any request
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: builtins.list[str]) -> None:
        by_full = {self.client.full_key(key): key for key in keys}

        def attempt() -> None:
            answer = self.client.call(
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

        self.client.retrying(f"batch delete ({len(keys)} keys, from)", keys[0], attempt)

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
                self.client.abort_upload(key, upload_id)
            log.info("aborted %d stale multipart uploads in %s", len(stale), self.label)
        return [key for key, _ in stale]

    def _open_uploads(self) -> Iterator[tuple[str, str, float]]:
        root = f"{self.prefix}/" if self.prefix else ""
        markers: dict[str, str] = {}
        while True:
            params = {"Prefix": root, **markers}
            page = self.client.retrying(
                "list uploads", "", partial(self.client.call, "list_multipart_uploads", "", **params)
            )
            for upload in page.get("Uploads", []):
                started = upload["Initiated"].timestamp()
                yield str(upload["Key"])[len(root) :], upload["UploadId"], started
            if not page.get("IsTruncated"):
                return
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def close(self) -> None:
        """Close the client and its connections before returning. s3fs's own close gives the
        client 0.1 s, then closes the connector from this thread, which only schedules each
        socket's close on the event loop: on a loaded machine a connection outlived
        ``close()``. Waited here up to :data:`CLOSE_TIMEOUT` seconds; s3fs's path after that."""
        creator = getattr(self.client.fs, "_s3creator", None)
        if creator is None or self._closed:
            return
        self._closed = True
        loop = self.client.fs.loop
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
