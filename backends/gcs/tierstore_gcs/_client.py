"""``GCSClient``: one bucket prefix over the GCS JSON API, the requests the backend, its
writer and its reader all send.

The backend's operations, the writer's resumable upload and the reader's ranged GETs build on
this alone, so none of them imports another (docs/design.md: no import cycle).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

from tierstore import retry as retry_mod
from tierstore.errors import (
    ChecksumMismatch,
    ConfigError,
    StorageError,
    TierstoreError,
    TransientStorageError,
)
from tierstore.storage.backend import check_key
from tierstore_gcs._errors import exception_error, response_error
from tierstore_gcs._http import Buffer, ClientBuildError, Response, Transport
from tierstore_gcs._sessions import SessionFile
from tierstore_gcs._wire import decode_crc32c, multipart_body

__all__ = ["FIELDS", "GCSClient", "fs_options"]

log = logging.getLogger(__name__)
T = TypeVar("T")

FIELDS = "name,size,updated,crc32c,generation"  # of an object, as a stat and a listing ask
_NO_EMULATOR = ("", "default")


def fs_options(
    endpoint_url: str | None, token: Any, project: str | None, gcsfs_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What ``gcsfs.GCSFileSystem`` is built with, for the transport."""
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


class GCSClient:
    """Requests about keys under ``bucket/prefix`` of the tier ``label``, through
    ``transport``: each translated into tierstore's errors, each retried unit run under
    ``retry``; resumable sessions recorded under ``session_dir`` (``None``: not recorded)."""

    def __init__(
        self,
        transport: Transport,
        bucket: str,
        prefix: str,
        label: str,
        *,
        part_size: int,
        retry: retry_mod.RetryPolicy,
        session_dir: str | None,
    ) -> None:
        self.transport = transport
        self.bucket = bucket
        self.prefix = prefix
        self.label = label
        self.part_size = part_size
        self.retry = retry
        self.session_dir = session_dir

    def name(self, key: str) -> str:
        check_key(key, tier=self.label)
        return f"{self.prefix}/{key}" if self.prefix else key

    def object_url(self, name: str) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(name, safe='')}"

    def list_url(self) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def upload_url(self) -> str:
        return f"/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def request(
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
            response = self.transport.request(method, url, params=params, headers=headers, body=body)
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

    def retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one idempotent unit under the tier's retry policy."""
        return self.retry.call(fn, what=f"GCS {what} of {key!r} in {self.label}")

    def metadata_once(self, key: str, *, what: str = "stat") -> dict[str, Any]:
        response = self.request(what, key, "GET", self.object_url(self.name(key)), params={"fields": FIELDS})
        return response.json()

    def read_range(self, key: str, generation: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes ``[start, stop)`` of one generation of ``key``: one retried unit."""
        return self.retrying("read", key, lambda: self.read_range_once(key, generation, start, stop))

    def read_range_once(self, key: str, generation: str, start: int, stop: int) -> bytes | bytearray:
        params = {"alt": "media"}
        if generation:
            params["generation"] = generation  # the object we stat'ed, never a newer one
        body = self.request(
            "read",
            key,
            "GET",
            self.object_url(self.name(key)),
            ok=(200, 206),
            params=params,
            headers={"Range": f"bytes={start}-{stop - 1}"},
        ).body
        if len(body) != stop - start:
            raise TransientStorageError(
                f"read: got {len(body)} of {stop - start} bytes at offset {start}", key=key, tier=self.label
            )
        return body

    def upload_small(self, key: str, data: Buffer, crc32c: int, *, exclusive: bool = False) -> dict[str, Any]:
        """One multipart upload (one attempt); ``exclusive`` adds ``ifGenerationMatch=0``."""
        content_type, body = multipart_body(self.name(key), data, crc32c)
        params = {"uploadType": "multipart"}
        if exclusive:
            params["ifGenerationMatch"] = "0"
        what = "publish" if exclusive else "upload"
        response = self.request(
            what,
            key,
            "POST",
            self.upload_url(),
            ok=(200, 201),
            params=params,
            headers={"Content-Type": content_type},
            body=body,
            missing=f"bucket {self.bucket!r}",
        )
        return response.json()

    def session_file(self, key: str) -> SessionFile | None:
        """Where a write of ``key`` records its resumable session (``None``: not recorded)."""
        if self.session_dir is None:
            return None
        try:
            endpoint = self.transport.endpoint()
        except ClientBuildError:  # the upload's first request reports it
            return None
        return SessionFile(self.session_dir, endpoint, self.bucket, self.name(key))

    def start_session(self, key: str) -> str:
        """A resumable upload session for ``key``; its URL is a secret (see ``_http``)."""

        def once() -> str:
            response = self.request(
                "start upload",
                key,
                "POST",
                self.upload_url(),
                params={"uploadType": "resumable"},
                headers={
                    "Content-Type": "application/json",
                    "X-Upload-Content-Type": "application/octet-stream",
                },
                body=[_json_name(self.name(key))],
                missing=f"bucket {self.bucket!r}",
            )
            location = response.headers.get("Location")
            if not location:
                raise StorageError("start upload: no session in the answer", key=key, tier=self.label)
            return location

        return self.retrying("start upload", key, once)

    def verify(self, key: str, resource: Mapping[str, Any], size: int, crc32c: int) -> None:
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
        self.discard(key, generation=resource.get("generation"))
        raise ChecksumMismatch(
            f"uploaded object differs from the bytes sent: size {stored_size} (expected "
            f"{size}), CRC32C {shown} (expected {crc32c:08x}); the object was deleted",
            key=key,
            tier=self.label,
            expected=(size, crc32c),
            actual=(stored_size, stored_crc),
        )

    def discard(self, key: str, *, generation: Any = None) -> None:
        """Best effort: remove an upload that failed (only ``generation``, when given)."""
        params = {"ifGenerationMatch": str(generation)} if generation else None
        try:
            self.retrying(
                "discard",
                key,
                lambda: self.request(
                    "discard",
                    key,
                    "DELETE",
                    self.object_url(self.name(key)),
                    ok=(200, 204, 404, 412),
                    params=params,
                ),
            )
        except StorageError as err:
            log.warning("could not remove failed upload %s from %s: %s", key, self.label, err)

    def cancel_session(self, key: str, session: str) -> None:
        """Best effort: an unfinished session is never visible and expires within a week."""
        try:
            # 499 is GCS's "cancelled" answer.
            self.request("cancel upload", key, "DELETE", session, ok=(200, 204, 404, 410, 499))
        except StorageError as err:
            log.debug("could not cancel an upload session for %s in %s: %s", key, self.label, err)


def _json_name(name: str) -> bytes:
    return json.dumps({"name": name}).encode()
