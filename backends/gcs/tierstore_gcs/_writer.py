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

Each chunk GCS confirmed is reported (``ObjectWriter.report_stored``) and recorded with its
session (:mod:`tierstore_gcs._sessions`). A write that finds its key's record takes the
recorded number of bytes without sending them and, if their CRC32C is the one recorded,
goes on in that session from there; if not, or if the session turns out gone, it forgets
the record and fails with a :class:`~tierstore.errors.TransientStorageError`, so the
caller's retry sends the object whole (the skipped bytes are no longer at hand). What a
resumed session stores is verified whole like any upload; a mismatch there is transient too.
``suspend()``, and a failure another try may cure, keep the session and its record.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tierstore.errors import ChecksumMismatch, StorageError, TierstoreError, TransientStorageError
from tierstore.storage.backend import ObjectWriter, crc32c_update
from tierstore_gcs._http import Response
from tierstore_gcs._sessions import SessionFile, Tracked
from tierstore_gcs._wire import PART_QUANTUM

if TYPE_CHECKING:
    from tierstore_gcs._client import GCSClient

__all__ = ["GCSWriter"]

log = logging.getLogger(__name__)

_SESSION_GONE = (404, 410)


class _SessionUnusable(StorageError):
    """A resumed session cannot take this write: not retried in it, sent again whole instead."""


def _persisted(response: Response) -> int:
    """Bytes GCS holds after a 308: ``Range: bytes=0-N`` means N + 1; no header, none."""
    value = response.headers.get("Range", "")
    _, _, last = value.partition("-")
    return int(last) + 1 if last.strip().isdigit() else 0


class GCSWriter(ObjectWriter):
    def __init__(self, client: GCSClient, key: str) -> None:
        super().__init__(key)
        self._client = client
        self._part = client.part_size
        self._buf = bytearray()
        self._filled = 0  # bytes at the front of _buf, not yet confirmed by GCS
        self._offset = 0  # object offset of _buf[0]
        self._persisted = 0  # bytes GCS confirmed
        self._session: str | None = None
        self._started = 0.0  # when the session began (time.time())
        self._sent_crc = 0  # CRC32C of the bytes GCS confirmed
        self._record: SessionFile | None = None  # where the session is recorded
        self._looked = False  # whether a recorded session was looked for
        self._resume: Tracked | None = None  # a recorded session, until its bytes are checked
        self._skipped = 0  # bytes taken without sending, and their CRC32C
        self._skipped_crc = 0
        self._adopted = False  # the session is a recorded one, not this writer's own

    # -- buffering -------------------------------------------------------------------

    def _write(self, view: memoryview) -> None:
        if not self._looked:
            self._looked = True
            self._record = self._client.session_file(self.key)
            self._resume = self._record.load() if self._record is not None else None
        if self._resume is not None:
            view = self._skip(view)
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

    # -- resuming a recorded session -------------------------------------------------

    def _skip(self, view: memoryview) -> memoryview:
        """Take bytes the recorded session holds already: checked, not sent."""
        assert self._resume is not None
        n = min(self._resume.offset - self._skipped, len(view))
        self._skipped_crc = crc32c_update(self._skipped_crc, view[:n])
        self._skipped += n
        if self._skipped == self._resume.offset:
            self._adopt(self._resume)
        return view[n:]

    def _adopt(self, tracked: Tracked) -> None:
        self._resume = None
        if self._skipped_crc != tracked.crc32c:
            self._forget()
            raise TransientStorageError(
                f"upload: the recorded resumable session holds {tracked.offset} bytes other "
                "than these; the object is sent again",
                key=self.key,
                tier=self._client.label,
            )
        self._session, self._started, self._adopted = tracked.session, tracked.started, True
        self._offset = self._persisted = tracked.offset
        self._sent_crc = tracked.crc32c
        log.info("resuming an upload of %s in %s at byte %d", self.key, self._client.label, tracked.offset)
        self._stored(tracked.offset)

    def _forget(self) -> None:
        """Drop the record, so no later write tries the session again. The session is not
        cancelled: it may be another writer's, and an unfinished one is never visible."""
        if self._record is not None:
            self._record.drop()

    # -- resumable upload ------------------------------------------------------------

    def _send_parts(self) -> None:
        """Upload every whole 256 KiB of the buffer; keep the rest at its front."""
        if self._session is None:
            self._session = self._client.start_session(self.key)
            self._started = time.time()
        end = self._offset + self._filled
        while end - self._persisted >= PART_QUANTUM:
            stop = self._persisted + (end - self._persisted) // PART_QUANTUM * PART_QUANTUM
            before = self._persisted
            self._put(stop, total=None)
            self._confirmed(before)
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

        try:
            return self._client.retrying("upload", self.key, once)
        except _SessionUnusable as err:
            self._forget()
            raise TransientStorageError(
                f"{err.message}; the object is sent again", key=self.key, tier=self._client.label
            ) from err

    def _confirmed(self, before: int) -> None:
        """GCS confirmed the bytes from ``before`` to ``_persisted``: record and report them."""
        if self._persisted == before:
            return
        start, stop = before - self._offset, self._persisted - self._offset
        self._sent_crc = crc32c_update(self._sent_crc, memoryview(self._buf)[start:stop])
        if self._record is not None and self._session is not None:
            self._record.save(Tracked(self._session, self._persisted, self._sent_crc, self._started))
        self._stored(self._persisted - before)

    def _put_once(self, stop: int, total: int | None) -> Response:
        assert self._session is not None
        start = self._persisted
        span = f"bytes {start}-{stop - 1}" if stop > start else "bytes *"
        view = memoryview(self._buf)[start - self._offset : stop - self._offset]
        return self._client.request(
            "upload",
            self.key,
            "PUT",
            self._session,
            ok=(200, 201, 308, *_SESSION_GONE),
            headers={"Content-Range": f"{span}/{'*' if total is None else total}"},
            body=[view] if len(view) else [],
        )

    def _progress(self, response: Response, stop: int, total: int | None) -> dict[str, Any] | None:
        label = self._client.label
        if response.status != 308:
            if total is None:
                raise StorageError(
                    "upload: GCS completed the object before its last part", key=self.key, tier=label
                )
            return response.json()
        persisted = _persisted(response)
        if not self._persisted <= persisted <= stop:
            if self._adopted:
                raise _SessionUnusable(
                    f"upload: the resumed session holds {persisted} bytes, not {self._persisted}",
                    key=self.key,
                    tier=label,
                )
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
            return self._client.metadata_once(self.key, what="upload read-back")
        if self._adopted:  # the bytes before the buffer were never at hand: start over
            raise _SessionUnusable(
                "upload: the resumed session no longer exists (expired or cancelled)",
                key=self.key,
                tier=self._client.label,
            )
        raise StorageError(
            "upload: the resumable session no longer exists (expired or cancelled)",
            key=self.key,
            tier=self._client.label,
        )

    def _finish(self) -> dict[str, Any]:
        total = self._offset + self._filled
        while True:
            before = self._persisted
            resource = self._put(total, total=total)
            if resource is not None:
                return resource
            self._confirmed(before)

    # -- commit and abort ------------------------------------------------------------

    def _upload(self) -> dict[str, Any]:
        if self._session is not None:
            return self._finish()
        data = memoryview(self._buf)[: self._filled]
        return self._client.retrying(
            "upload", self.key, lambda: self._client.upload_small(self.key, data, self.crc32c)
        )

    def _commit(self) -> None:
        try:
            if self._resume is not None:
                self._forget()
                raise TransientStorageError(
                    f"upload: the recorded resumable session holds more bytes ({self._resume.offset}) "
                    f"than this object has ({self.size}); the object is sent again",
                    key=self.key,
                    tier=self._client.label,
                )
            resource = self._upload()
        except BaseException as err:
            if isinstance(err, TierstoreError) and not isinstance(err, TransientStorageError):
                self._cleanup()
            # else: another try may cure it (or the process is going): keep the session for it
            raise
        finally:
            self._buf = bytearray()
        self._forget()  # the session is spent
        # Durable and complete only once what GCS stored matches (docs/design.md invariant 2).
        try:
            self._client.verify(self.key, resource, self.size, self.crc32c)
        except ChecksumMismatch as err:
            if not self._adopted:
                raise
            raise TransientStorageError(
                "upload: the resumed session stored other bytes than these (deleted); "
                "the object is sent again",
                key=self.key,
                tier=self._client.label,
            ) from err
        generation = resource.get("generation")
        self.version = str(generation) if generation else None  # the generation just checked

    def _cleanup(self) -> None:
        # Never delete the key here: the failed request may have created the object (our
        # own bytes, CRC32C-checked by GCS), but another migrator of the same checkpoint may
        # have stored its verified copy there too, and a delete cannot tell them apart.
        # Nothing vouches for an object until it is checked in place (tierstore.migration.migrator).
        self._forget()
        if self._session is not None:
            self._client.cancel_session(self.key, self._session)

    def _abort(self) -> None:
        self._buf = bytearray()
        self._cleanup()

    def _suspend(self) -> None:
        self._buf = bytearray()  # the session and its record stay for the next write of the key
