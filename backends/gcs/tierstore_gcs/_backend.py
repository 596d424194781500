"""The Google Cloud Storage tier: ``gs://bucket[/prefix]`` over the GCS JSON API.

The backend contract's every operation mapped to the GCS JSON API (generation preconditions,
listed CRC32C, resumable uploads); the requests themselves go through
:mod:`tierstore_gcs._client`, which the writer and the reader, modules of their own, use too.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, BinaryIO, TypeVar, cast

from tierstore import retry as retry_mod
from tierstore._redact import redact_url
from tierstore.errors import (
    ConfigError,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    StorageError,
    TransientStorageError,
)
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key, crc32c_update
from tierstore_gcs._client import FIELDS, GCSClient, fs_options
from tierstore_gcs._http import CONNECT_TIMEOUT, READ_TIMEOUT, Transport
from tierstore_gcs._reader import RangeReader
from tierstore_gcs._sessions import DEFAULT_SESSION_DIR
from tierstore_gcs._wire import PART_QUANTUM, decode_crc32c, parse_time, parse_url
from tierstore_gcs._writer import GCSWriter

__all__ = ["GCSBackend", "DEFAULT_PART_SIZE", "PART_QUANTUM"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PART_SIZE = 16 << 20
_LIST_FIELDS = f"items({FIELDS}),nextPageToken"
_LIST_PAGE = "1000"
# delete_many: DELETEs in flight at once. Not the JSON batch API: its multipart/mixed
# answers would need a parser of their own, and a few parallel requests already turn
# minutes of serial deletes into seconds.
DELETE_THREADS = 16


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
        if options:
            raise ConfigError(f"unknown options for a GCS tier: {sorted(options)}")
        bucket, prefix = parse_url(str(url))
        part_size = _check_part_size(part_size)
        if not (connect_timeout > 0 and read_timeout > 0):
            raise ConfigError("connect_timeout and read_timeout must be positive seconds")
        transport = Transport(
            fs_options(endpoint_url, token, project, gcsfs_options),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.client = GCSClient(
            transport,
            bucket,
            prefix,
            redact_url(url),
            part_size=part_size,
            retry=retry or retry_mod.DEFAULT,
            session_dir=None if session_dir is None else os.path.expanduser(os.fspath(session_dir)),
        )
        super().__init__(url)  # after the client: it holds the label

    # The settings, as the client holds them.

    @property
    def label(self) -> str:
        return self.client.label

    @label.setter
    def label(self, label: str) -> None:  # the registry names the tier ("hot gs://...")
        self.client.label = label

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
    def retry(self) -> retry_mod.RetryPolicy:
        return self.client.retry

    @property
    def session_dir(self) -> str | None:
        return self.client.session_dir

    # -- metadata --------------------------------------------------------------------

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
        self.client.name(key)  # reject unsafe keys before any request
        return self._info(key, self.client.retrying("stat", key, lambda: self.client.metadata_once(key)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        if prefix:
            check_key(prefix[:-1], tier=self.label)
        root = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            page = self.client.retrying("list", prefix, partial(self._list_page, root + prefix, token))
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
        return self.client.request(
            "list", prefix, "GET", self.client.list_url(), params=params, missing=f"bucket {self.bucket!r}"
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
        self.client.name(key)
        resource = self.client.retrying("stat", key, lambda: self.client.metadata_once(key))
        size, generation = int(resource.get("size", 0)), str(resource.get("generation", ""))
        raw = RangeReader(self.client, key, size, generation, self.part_size)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=PART_QUANTUM))

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """One ranged GET (no metadata request first), fetched whole: one retried unit."""
        self.client.name(key)
        if length <= 0:
            self.stat(key)  # still: a missing key is ObjectNotFound
            return io.BytesIO(b"")
        return io.BytesIO(
            self.client.retrying(
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
        self.client.name(key)
        wanted = None if limit is None else limit + 1
        data = self.client.retrying("read", key, lambda: self._get_range_once(key, 0, wanted))
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"object larger than {limit} bytes", key=key, tier=self.label)
        return data

    def _get_range_once(self, key: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes from ``offset`` (``None``: the whole object, no range asked)."""
        headers = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}
        response = self.client.request(
            "read",
            key,
            "GET",
            self.client.object_url(self.client.name(key)),
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

    # -- writes ----------------------------------------------------------------------

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self.client.name(key)  # reject unsafe keys now, not at the first upload
        return GCSWriter(self.client, key)

    # -- publish ---------------------------------------------------------------------

    def publish(self, key: str, data: bytes) -> None:
        self.client.name(key)
        data = bytes(data)
        crc = crc32c_update(0, data)
        ambiguous = False

        def once() -> dict[str, Any]:
            nonlocal ambiguous
            try:
                return self.client.upload_small(key, data, crc, exclusive=True)
            except PublishConflict:
                if not ambiguous:
                    raise
                return self._resolve_publish(key, data)
            except TransientStorageError:
                ambiguous = True  # it may have landed: docs/design.md invariant 12
                raise

        resource = self.client.retrying("publish", key, once)
        self.client.verify(key, resource, len(data), crc)

    def _resolve_publish(self, key: str, data: bytes) -> dict[str, Any]:
        """After an ambiguous attempt a retry found the key taken: is it ours?

        Single attempts only: a transient failure here fails this publish attempt, and
        the retry of the whole unit (upload, then read-back) starts over.
        """
        try:
            resource = self.client.metadata_once(key, what="publish read-back")
            same = int(resource.get("size", -1)) == len(data)
            if same and data:
                generation = str(resource.get("generation", ""))
                same = self.client.read_range_once(key, generation, 0, len(data)) == data
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
        url = self.client.object_url(self.client.name(key))
        self.client.retrying(
            "delete", key, lambda: self.client.request("delete", key, "DELETE", url, ok=(200, 204, 404))
        )

    def delete_if(self, key: str, version: str) -> bool:
        """A DELETE with ``ifGenerationMatch``: GCS itself compares (412: another object).
        The generation is read first as well: fake-gcs-server ignores the precondition on a
        DELETE, and that read makes the common case right there too."""
        try:
            if self.stat(key).version != version:
                return False
        except ObjectNotFound:
            return True
        url = self.client.object_url(self.client.name(key))
        response = self.client.retrying(
            "conditional delete",
            key,
            lambda: self.client.request(
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
        keys = [key for key in keys if self.client.name(key)]  # unsafe keys: rejected up front
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
        self.client.transport.close()
