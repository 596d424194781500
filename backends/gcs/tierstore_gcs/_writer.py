"""Streaming writes: one request for a small object, a resumable upload for a large one.

Memory is one part (``part_size``), whatever the object's size. Parts go out lazily, when
the next byte needs the room, so an object of up to ``part_size`` bytes is one request
and the final request of a resumable upload always carries data.

Each request of a resumable upload is one retried unit. A retry re-sends everything
after the last offset GCS confirmed, under the same ``Content-Range``, as Google's own
clients retry a chunk: GCS takes a repeat of bytes it already holds. (The stricter
status query, ``Content-Range: bytes */*``, is not used: fake-gcs-server completes the
upload when asked, fsouza/fake-gcs-server#1149.) A retried final request that finds its
session gone (the lost attempt completed it) reads the object's metadata instead;
either way the stored size and CRC32C are checked against ours before ``close()``
returns. fake-gcs-server appends every chunk it receives, so on it a chunk whose answer
was lost after it landed is stored twice: that shows up at the check as a
:class:`~tierstore.errors.ChecksumMismatch`, never as silent corruption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierstore.errors import StorageError, TransientStorageError
from tierstore.storage.backend import ObjectWriter
from tierstore_gcs._http import Response
from tierstore_gcs._wire import PART_QUANTUM

if TYPE_CHECKING:
    from tierstore_gcs._backend import GCSBackend

__all__ = ["GCSWriter"]

_SESSION_GONE = (404, 410)


def _persisted(response: Response) -> int:
    """Bytes GCS holds after a 308: ``Range: bytes=0-N`` means N + 1; no header, none."""
    value = response.headers.get("Range", "")
    _, _, last = value.partition("-")
    return int(last) + 1 if last.strip().isdigit() else 0


class GCSWriter(ObjectWriter):
    def __init__(self, backend: GCSBackend, key: str) -> None:
        super().__init__(key)
        self._backend = backend
        self._part = backend.part_size
        self._buf = bytearray()
        self._filled = 0  # bytes at the front of _buf, not yet confirmed by GCS
        self._offset = 0  # object offset of _buf[0]
        self._persisted = 0  # bytes GCS confirmed
        self._session: str | None = None

    # -- buffering -------------------------------------------------------------------

    def _write(self, view: memoryview) -> None:
        while len(view):
            if self._filled == self._part:
                self._send_parts()
            n = min(self._part - self._filled, len(view))
            self._fill(view[:n])
            view = view[n:]

    def _fill(self, chunk: memoryview) -> None:
        end = self._filled + len(chunk)
        if self._filled == len(self._buf):
            self._buf += chunk  # growing towards one part; never past it
        else:
            self._buf[self._filled : end] = chunk  # reusing the part buffer: no resize
        self._filled = end

    # -- resumable upload ------------------------------------------------------------

    def _send_parts(self) -> None:
        """Upload every whole 256 KiB of the buffer; keep the rest at its front."""
        if self._session is None:
            self._session = self._backend._start_session(self.key)
        end = self._offset + self._filled
        while end - self._persisted >= PART_QUANTUM:
            stop = self._persisted + (end - self._persisted) // PART_QUANTUM * PART_QUANTUM
            self._put(stop, total=None)
        keep, start = end - self._persisted, self._persisted - self._offset
        if keep:
            self._buf[:keep] = self._buf[start : start + keep]
        self._offset, self._filled = self._persisted, keep

    def _put(self, stop: int, total: int | None) -> dict[str, Any] | None:
        """Send bytes up to ``stop``; the object's resource once ``total`` completes it."""
        ambiguous = False

        def once() -> dict[str, Any] | None:
            nonlocal ambiguous
            try:
                response = self._put_once(stop, total)
            except TransientStorageError:
                ambiguous = True
                raise
            if response.status in _SESSION_GONE:
                return self._session_gone(total, ambiguous)
            return self._progress(response, stop, total)

        return self._backend._retrying("upload", self.key, once)

    def _put_once(self, stop: int, total: int | None) -> Response:
        assert self._session is not None
        start = self._persisted
        span = f"bytes {start}-{stop - 1}" if stop > start else "bytes *"
        view = memoryview(self._buf)[start - self._offset : stop - self._offset]
        return self._backend._request(
            "upload",
            self.key,
            "PUT",
            self._session,
            ok=(200, 201, 308, *_SESSION_GONE),
            headers={"Content-Range": f"{span}/{'*' if total is None else total}"},
            body=[view] if len(view) else [],
        )

    def _progress(self, response: Response, stop: int, total: int | None) -> dict[str, Any] | None:
        label = self._backend.label
        if response.status != 308:
            if total is None:
                raise StorageError(
                    "upload: GCS completed the object before its last part", key=self.key, tier=label
                )
            return response.json()
        persisted = _persisted(response)
        if not self._persisted <= persisted <= stop:
            raise StorageError(
                f"upload: GCS reports {persisted} bytes stored, expected {self._persisted} to {stop}",
                key=self.key,
                tier=label,
            )
        if persisted == self._persisted:  # no progress: back off rather than spin
            raise TransientStorageError("upload: GCS took none of the bytes sent", key=self.key, tier=label)
        self._persisted = persisted
        return None

    def _session_gone(self, total: int | None, ambiguous: bool) -> dict[str, Any]:
        if total is not None and ambiguous:
            # The lost final attempt may have completed the object: what is stored is
            # checked against our size and CRC32C like any other answer.
            return self._backend._metadata_once(self.key, what="upload read-back")
        raise StorageError(
            "upload: the resumable session no longer exists (expired or cancelled)",
            key=self.key,
            tier=self._backend.label,
        )

    def _finish(self) -> dict[str, Any]:
        total = self._offset + self._filled
        while True:
            resource = self._put(total, total=total)
            if resource is not None:
                return resource

    # -- commit and abort ------------------------------------------------------------

    def _upload(self) -> dict[str, Any]:
        if self._session is not None:
            return self._finish()
        data = memoryview(self._buf)[: self._filled]
        return self._backend._retrying(
            "upload", self.key, lambda: self._backend._upload_small(self.key, data, self.crc32c)
        )

    def _commit(self) -> None:
        try:
            resource = self._upload()
        except BaseException:
            self._cleanup()
            raise
        finally:
            self._buf = bytearray()
        # Durable and complete only once what GCS stored matches (docs/design.md invariant 2).
        self._backend._verify(self.key, resource, self.size, self.crc32c)
        generation = resource.get("generation")
        self.version = str(generation) if generation else None  # the generation just checked

    def _cleanup(self) -> None:
        # Never delete the key here: the failed request may have created the object (our
        # own bytes, CRC32C-checked by GCS), but another migrator of the same checkpoint may
        # have stored its verified copy there too, and a delete cannot tell them apart.
        # Nothing vouches for an object until it is checked in place (tierstore.tiers.migrator).
        if self._session is not None:
            self._backend._cancel_session(self.key, self._session)

    def _abort(self) -> None:
        self._buf = bytearray()
        if self._session is not None:
            self._backend._cancel_session(self.key, self._session)
