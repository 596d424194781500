"""The Google Cloud Storage tier: ``gs://bucket[/prefix]`` over the GCS JSON API.

Why one module of about 520 lines: it is the backend contract's every operation mapped to the
GCS JSON API (generation preconditions, listed CRC32C, resumable uploads); the writer and the
reader are their own modules.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import quote

from tierstore import retry as retry_mod
from tierstore.errors import (
    ChecksumMismatch,
    ConfigError,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    StorageError,
    TierstoreError,
    TransientStorageError,
)
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key, crc32c_update
from tierstore_gcs._errors import exception_error, response_error
from tierstore_gcs._http import CONNECT_TIMEOUT, READ_TIMEOUT, Buffer, ClientBuildError, Response, Transport
from tierstore_gcs._reader import RangeReader
from tierstore_gcs._sessions import DEFAULT_SESSION_DIR, SessionFile
from tierstore_gcs._wire import PART_QUANTUM, decode_crc32c, multipart_body, parse_time, parse_url
from tierstore_gcs._writer import GCSWriter

__all__ = ["GCSBackend", "DEFAULT_PART_SIZE", "PART_QUANTUM"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PART_SIZE = 16 << 20
_FIELDS = "name,size,updated,crc32c,generation"
_LIST_FIELDS = f"items({_FIELDS}),nextPageToken"
_LIST_PAGE = "1000"
_NO_EMULATOR = ("", "default")
# delete_many: DELETEs in flight at once. Not the JSON batch API: its multipart/mixed
# answers would need a parser of their own, and a few parallel requests already turn
# minutes of serial deletes into seconds.
DELETE_THREADS = 16


def _fs_options(
    endpoint_url: str | None, token: Any, project: str | None, gcsfs_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    options = dict(gcsfs_options or {})
    if endpoint_url is not None:
        options["endpoint_url"] = endpoint_url  # else gcsfs reads STORAGE_EMULATOR_HOST itself
    if project is not None:
        options["project"] = project
    if token is None and os.environ.get("STORAGE_EMULATOR_HOST", "") not in _NO_EMULATOR:
        token = "anon"  # an emulator takes no credentials; don't go looking for any
    if token is not None:
        options["token"] = token
    return options


def _check_part_size(part_size: int) -> int:
    if not isinstance(part_size, int) or part_size <= 0 or part_size % PART_QUANTUM:
        raise ConfigError(
            f"part_size must be a positive multiple of {PART_QUANTUM} bytes (256 KiB), got {part_size!r}"
        )
    return part_size


class GCSBackend(Backend):
    """Objects in a GCS bucket under an optional prefix: ``gs://bucket[/prefix]`` (or ``gcs://``).

    Options: ``endpoint_url`` (else ``STORAGE_EMULATOR_HOST``, else Google), ``token``
    (any form gcsfs accepts; ``"anon"`` by default when ``STORAGE_EMULATOR_HOST`` is
    set), ``project``, ``part_size`` (resumable-upload chunk and read block, a multiple
    of 256 KiB), ``gcsfs_options`` (passed to ``gcsfs.GCSFileSystem``), ``retry`` (a
    :class:`tierstore.retry.RetryPolicy`; default :data:`tierstore.retry.DEFAULT`), and
    ``connect_timeout`` / ``read_timeout`` in seconds per request (default 30 / 120): how
    long a stalled server can hold one request before it is retried; ``session_dir``, where
    resumable uploads are recorded so that a rerun goes on where a killed one stopped
    (default ``~/.cache/tierstore/gcs-sessions``; ``None``: not recorded; see
    :mod:`tierstore_gcs._sessions`).

    Writes stream: objects up to ``part_size`` go up in one request, larger ones as a
    resumable upload, one part in memory at a time. Every upload is verified against the
    size and CRC32C that GCS reports. ``publish`` is one upload with
    ``ifGenerationMatch=0``. Keys written through ``open_write`` may be overwritten; tierstore
    writes each key once per attempt (docs/design.md invariant 3).
    """

    scheme = "gs"
    spread_keys = True  # data keys over hashed prefixes, like S3

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        token: Any = None,
        project: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        gcsfs_options: Mapping[str, Any] | None = None,
        retry: retry_mod.RetryPolicy | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        session_dir: str | os.PathLike[str] | None = DEFAULT_SESSION_DIR,
        **options: Any,
    ) -> None:
        super().__init__(url)
        if options:
            raise ConfigError(f"unknown options for a GCS tier: {sorted(options)}")
        self.bucket, self.prefix = parse_url(str(url))
        self.part_size = _check_part_size(part_size)
        self.retry = retry or retry_mod.DEFAULT
        if not (connect_timeout > 0 and read_timeout > 0):
            raise ConfigError("connect_timeout and read_timeout must be positive seconds")
        self._transport = Transport(
            _fs_options(endpoint_url, token, project, gcsfs_options),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.session_dir = None if session_dir is None else os.path.expanduser(os.fspath(session_dir))

    # -- names and requests ------------------------------------------------------------

    def _name(self, key: str) -> str:
        check_key(key, tier=self.label)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _object_url(self, name: str) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(name, safe='')}"

    def _list_url(self) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def _upload_url(self) -> str:
        return f"/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def _request(
        self,
        what: str,
        key: str,
        method: str,
        url: str,
        *,
        ok: Sequence[int] = (200,),
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Sequence[Buffer] = (),
        missing: str = "object",
    ) -> Response:
        """One attempt, translated: an answer outside ``ok`` raises (``missing``: what a
        404 means here, see :func:`~tierstore_gcs._errors.status_error`)."""
        try:
            response = self._transport.request(method, url, params=params, headers=headers, body=body)
        except TierstoreError:
            raise
        except ClientBuildError as err:
            raise ConfigError(
                f"cannot build a GCS client ({err}); check the token= and gcsfs_options options",
                key=key,
                tier=self.label,
            ) from err
        except Exception as err:
            raise exception_error(err, what=what, key=key, tier=self.label) from err
        if response.status not in ok:
            raise response_error(response, what=what, key=key, tier=self.label, missing=missing)
        return response

    def _retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one idempotent unit under the tier's retry policy."""
        return self.retry.call(fn, what=f"GCS {what} of {key!r} in {self.label}")

    # -- metadata --------------------------------------------------------------------

    def _metadata_once(self, key: str, *, what: str = "stat") -> dict[str, Any]:
        response = self._request(
            what, key, "GET", self._object_url(self._name(key)), params={"fields": _FIELDS}
        )
        return response.json()

    def _info(self, key: str, resource: Mapping[str, Any]) -> ObjectInfo:
        generation = resource.get("generation")
        return ObjectInfo(
            key=key,
            size=int(resource.get("size", 0)),
            mtime=parse_time(resource.get("updated")),
            crc32c=decode_crc32c(resource.get("crc32c")),
            version=str(generation) if generation else None,
        )

    def stat(self, key: str) -> ObjectInfo:
        self._name(key)  # reject unsafe keys before any request
        return self._info(key, self._retrying("stat", key, lambda: self._metadata_once(key)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        if prefix:
            check_key(prefix[:-1], tier=self.label)
        root = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            page = self._retrying("list", prefix, partial(self._list_page, root + prefix, token))
            for item in page.get("items", []):
                info = self._listed(item, root)
                if info is not None:
                    yield info
            token = page.get("nextPageToken")
            if not token:
                return

    def _list_page(self, prefix: str, token: str | None) -> dict[str, Any]:
        params = {"prefix": prefix, "maxResults": _LIST_PAGE, "fields": _LIST_FIELDS}
        if token:
            params["pageToken"] = token
        return self._request(
            "list", prefix, "GET", self._list_url(), params=params, missing=f"bucket {self.bucket!r}"
        ).json()

    def _listed(self, item: Mapping[str, Any], root: str) -> ObjectInfo | None:
        key = str(item.get("name", ""))[len(root) :]
        try:
            check_key(key)
        except StorageError:
            # Folder placeholders ("a/b/") and names no key can produce ("a//b"),
            # written by other tools: not objects of this tier.
            log.debug("skipping object %r in %s: not a valid key", key, self.label)
            return None
        return self._info(key, item)

    # -- reads -----------------------------------------------------------------------

    def open_read(self, key: str) -> BinaryIO:
        self._name(key)
        resource = self._retrying("stat", key, lambda: self._metadata_once(key))
        size, generation = int(resource.get("size", 0)), str(resource.get("generation", ""))
        raw = RangeReader(self, key, size, generation, self.part_size)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=PART_QUANTUM))

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """One ranged GET (no metadata request first), fetched whole: one retried unit."""
        self._name(key)
        if length <= 0:
            self.stat(key)  # still: a missing key is ObjectNotFound
            return io.BytesIO(b"")
        return io.BytesIO(
            self._retrying(
                f"read of bytes {offset}-{offset + length - 1}",
                key,
                lambda: self._get_range_once(key, offset, length),
            )
        )

    def read_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """One GET, of the first ``limit`` + 1 bytes with a limit: one version read whole,
        with no metadata request before it. A stat, then a GET pinned to the generation it
        saw, let a delete in between turn "no such object" (what a caller acts on: a mark
        or manifest removed since it was listed) into a read error; one GET reads either
        the object as it is or nothing."""
        self._name(key)
        wanted = None if limit is None else limit + 1
        data = self._retrying("read", key, lambda: self._get_range_once(key, 0, wanted))
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"object larger than {limit} bytes", key=key, tier=self.label)
        return data

    def _get_range_once(self, key: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes from ``offset`` (``None``: the whole object, no range asked)."""
        headers = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}
        response = self._request(
            "read",
            key,
            "GET",
            self._object_url(self._name(key)),
            ok=(200, 206, 416),
            params={"alt": "media"},
            headers=headers,
        )
        if response.status == 416:  # the range starts past the end of the object
            return b""
        body = bytes(response.body)
        if length is None:
            return body
        if response.status == 200:  # the whole object: a server that ignored the range
            return body[offset : offset + length]
        sent = response.headers.get("Content-Range", "")  # "bytes <first>-<last>/<size>"
        first, _, last = sent.partition(" ")[2].partition("/")[0].partition("-")
        if first.isdigit() and last.isdigit() and len(body) != int(last) - int(first) + 1:
            raise TransientStorageError(
                f"read: range {sent} came back with {len(body)} bytes", key=key, tier=self.label
            )
        return body

    def _read_range(self, key: str, generation: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes ``[start, stop)`` of one generation of ``key``: one retried unit."""
        return self._retrying("read", key, lambda: self._read_range_once(key, generation, start, stop))

    def _read_range_once(self, key: str, generation: str, start: int, stop: int) -> bytes | bytearray:
        params = {"alt": "media"}
        if generation:
            params["generation"] = generation  # the object we stat'ed, never a newer one
        body = self._request(
            "read",
            key,
            "GET",
            self._object_url(self._name(key)),
            ok=(200, 206),
            params=params,
            headers={"Range": f"bytes={start}-{stop - 1}"},
        ).body
        if len(body) != stop - start:
            raise TransientStorageError(
                f"read: got {len(body)} of {stop - start} bytes at offset {start}", key=key, tier=self.label
            )
        return body

    # -- writes ----------------------------------------------------------------------

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self._name(key)  # reject unsafe keys now, not at the first upload
        return GCSWriter(self, key)

    def _upload_small(
        self, key: str, data: Buffer, crc32c: int, *, exclusive: bool = False
    ) -> dict[str, Any]:
        """One multipart upload (one attempt); ``exclusive`` adds ``ifGenerationMatch=0``."""
        content_type, body = multipart_body(self._name(key), data, crc32c)
        params = {"uploadType": "multipart"}
        if exclusive:
            params["ifGenerationMatch"] = "0"
        what = "publish" if exclusive else "upload"
        response = self._request(
            what,
            key,
            "POST",
            self._upload_url(),
            ok=(200, 201),
            params=params,
            headers={"Content-Type": content_type},
            body=body,
            missing=f"bucket {self.bucket!r}",
        )
        return response.json()

    def _session_file(self, key: str) -> SessionFile | None:
        """Where a write of ``key`` records its resumable session (``None``: not recorded)."""
        if self.session_dir is None:
            return None
        try:
            endpoint = self._transport.endpoint()
        except ClientBuildError:  # the upload's first request reports it
            return None
        return SessionFile(self.session_dir, endpoint, self.bucket, self._name(key))

    def _start_session(self, key: str) -> str:
        """A resumable upload session for ``key``; its URL is a secret (see ``_http``)."""

        def once() -> str:
            response = self._request(
                "start upload",
                key,
                "POST",
                self._upload_url(),
                params={"uploadType": "resumable"},
                headers={
                    "Content-Type": "application/json",
                    "X-Upload-Content-Type": "application/octet-stream",
                },
                body=[_json_name(self._name(key))],
                missing=f"bucket {self.bucket!r}",
            )
            location = response.headers.get("Location")
            if not location:
                raise StorageError("start upload: no session in the answer", key=key, tier=self.label)
            return location

        return self._retrying("start upload", key, once)

    def _verify(self, key: str, resource: Mapping[str, Any], size: int, crc32c: int) -> None:
        """Check what GCS stored against what we sent; delete it and raise if they differ."""
        stored_size = int(resource.get("size", -1))
        stored_crc = decode_crc32c(resource.get("crc32c"))
        if stored_size == size and stored_crc == crc32c:
            return
        shown = "none" if stored_crc is None else f"{stored_crc:08x}"
        log.error(
            "GCS stored %s in %s with size %d, CRC32C %s; we sent %d bytes, CRC32C %08x",
            key,
            self.label,
            stored_size,
            shown,
            size,
            crc32c,
        )
        self._discard(key, generation=resource.get("generation"))
        raise ChecksumMismatch(
            f"uploaded object differs from the bytes sent: size {stored_size} (expected "
            f"{size}), CRC32C {shown} (expected {crc32c:08x}); the object was deleted",
            key=key,
            tier=self.label,
            expected=(size, crc32c),
            actual=(stored_size, stored_crc),
        )

    def _discard(self, key: str, *, generation: Any = None) -> None:
        """Best effort: remove an upload that failed (only ``generation``, when given)."""
        params = {"ifGenerationMatch": str(generation)} if generation else None
        try:
            self._retrying(
                "discard",
                key,
                lambda: self._request(
                    "discard",
                    key,
                    "DELETE",
                    self._object_url(self._name(key)),
                    ok=(200, 204, 404, 412),
                    params=params,
                ),
            )
        except StorageError as err:
            log.warning("could not remove failed upload %s from %s: %s", key, self.label, err)

    def _cancel_session(self, key: str, session: str) -> None:
        """Best effort: an unfinished session is never visible and expires within a week."""
        try:
            # 499 is GCS's "cancelled" answer.
            self._request("cancel upload", key, "DELETE", session, ok=(200, 204, 404, 410, 499))
        except StorageError as err:
            log.debug("could not cancel an upload session for %s in %s: %s", key, self.label, err)

    # -- publish ---------------------------------------------------------------------

    def publish(self, key: str, data: bytes) -> None:
        self._name(key)
        data = bytes(data)
        crc = crc32c_update(0, data)
        ambiguous = False

        def once() -> dict[str, Any]:
            nonlocal ambiguous
            try:
                return self._upload_small(key, data, crc, exclusive=True)
            except PublishConflict:
                if not ambiguous:
                    raise
                return self._resolve_publish(key, data)
            except TransientStorageError:
                ambiguous = True  # it may have landed: docs/design.md invariant 12
                raise

        resource = self._retrying("publish", key, once)
        self._verify(key, resource, len(data), crc)

    def _resolve_publish(self, key: str, data: bytes) -> dict[str, Any]:
        """After an ambiguous attempt a retry found the key taken: is it ours?

        Single attempts only: a transient failure here fails this publish attempt, and
        the retry of the whole unit (upload, then read-back) starts over.
        """
        try:
            resource = self._metadata_once(key, what="publish read-back")
            same = int(resource.get("size", -1)) == len(data)
            if same and data:
                generation = str(resource.get("generation", ""))
                same = self._read_range_once(key, generation, 0, len(data)) == data
        except ObjectNotFound as err:
            # Taken a moment ago, gone now: the exclusive publish can be tried again.
            raise TransientStorageError(
                "publish: the conflicting object vanished", key=key, tier=self.label
            ) from err
        if not same:
            raise PublishConflict("publish: already published by another writer", key=key, tier=self.label)
        log.info("ambiguous publish of %s in %s resolved: the earlier attempt landed", key, self.label)
        return resource

    # -- delete and lifecycle --------------------------------------------------------

    def delete(self, key: str) -> None:
        url = self._object_url(self._name(key))
        self._retrying("delete", key, lambda: self._request("delete", key, "DELETE", url, ok=(200, 204, 404)))

    def delete_if(self, key: str, version: str) -> bool:
        """A DELETE with ``ifGenerationMatch``: GCS itself compares (412: another object).
        The generation is read first as well: fake-gcs-server ignores the precondition on a
        DELETE, and that read makes the common case right there too."""
        try:
            if self.stat(key).version != version:
                return False
        except ObjectNotFound:
            return True
        url = self._object_url(self._name(key))
        response = self._retrying(
            "conditional delete",
            key,
            lambda: self._request(
                "conditional delete",
                key,
                "DELETE",
                url,
                ok=(200, 204, 404, 412),
                params={"ifGenerationMatch": version},
            ),
        )
        return response.status != 412

    def delete_many(self, keys: Iterable[str]) -> None:
        """Parallel DELETEs, ``DELETE_THREADS`` at a time, each retried on its own; the
        first key that could not be deleted raises its error once every request ended."""
        keys = [key for key in keys if self._name(key)]  # unsafe keys: rejected up front
        if len(keys) <= 1:
            for key in keys:
                self.delete(key)
            return
        with ThreadPoolExecutor(
            min(DELETE_THREADS, len(keys)), thread_name_prefix="tierstore-gcs-delete"
        ) as pool:
            futures = [pool.submit(self.delete, key) for key in keys]
        for future in futures:
            future.result()

    def close(self) -> None:
        self._transport.close()


def _json_name(name: str) -> bytes:
    return json.dumps({"name": name}).encode()
