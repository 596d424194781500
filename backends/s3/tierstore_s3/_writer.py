"""Streaming object writes: one PutObject for small objects, else a bounded multipart upload.

Memory: the part being filled plus at most ``max_concurrency`` parts in flight, so about
``part_size * (max_concurrency + 1)`` bytes whatever the object's size. A part is shipped
only when more bytes follow it, so an object of exactly ``part_size`` is one PutObject and
the last part of a multipart upload is never empty.

Each part S3 acknowledged is reported (``ObjectWriter.report_stored``) on the writer's own
thread, as the next part is shipped or the upload completes. A multipart write resumes the
pending upload an interrupted write of its key left, reusing only parts proved to hold its
bytes (:mod:`tierstore_s3._resume`); ``suspend()``, and a failure another try may cure,
leave the upload pending for that.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from tierstore.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    StorageError,
    TierstoreError,
    TransientStorageError,
)
from tierstore.storage.backend import ObjectWriter, crc32c_update
from tierstore_s3 import _checksum
from tierstore_s3._errors import client_error_code
from tierstore_s3._resume import StoredPart, find_pending

if TYPE_CHECKING:
    from tierstore_s3._client import S3Client

__all__ = ["S3ObjectWriter"]

log = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit per multipart upload

_Finished = tuple[dict[str, Any], int]  # a part as CompleteMultipartUpload names it, and its size


class _MultipartUpload:
    """One multipart upload, new or resumed; parts go up on a small pool, each retried as a
    unit, and ``on_part(size)`` hears of each part S3 holds (on the writer's thread)."""

    def __init__(self, client: S3Client, key: str, on_part: Callable[[int], None]) -> None:
        self._client = client
        self._key = key
        self._full = client.full_key(key)
        self._on_part = on_part
        pending = find_pending(client, key)
        self.upload_id: str = pending.upload_id if pending is not None else self._create()
        self._stored: dict[int, StoredPart] = dict(pending.parts) if pending is not None else {}
        self.reused = 0  # parts of the pending upload found to hold our bytes, not sent again
        self.vanished = False  # completed or aborted by someone else before we completed it
        self.part_crcs: list[int] = []
        self._done: list[dict[str, Any]] = []
        self._pending: set[Future[_Finished]] = set()
        self._pool = ThreadPoolExecutor(client.max_concurrency, thread_name_prefix="tierstore-s3-part")
        self._aborted = False  # abort(): send nothing more
        self._stopping = False  # stop(): finish the requests in hand, retry none

    def _create(self) -> str:
        client, key = self._client, self._key
        extra = {"ChecksumType": "FULL_OBJECT"} if client.full_object_checksum else {}
        created = client.retrying(
            "start multipart upload",
            key,
            lambda: client.call(
                "create_multipart_upload", key, Key=self._full, ChecksumAlgorithm="CRC32C", **extra
            ),
        )
        log.debug("started multipart upload of %s in %s", key, client.label)
        return str(created["UploadId"])

    def wait_for_slot(self) -> None:
        """Block until fewer than ``max_concurrency`` parts are in flight."""
        self._settle(below=self._client.max_concurrency)

    def _settle(self, *, below: int) -> None:
        """Collect the parts finished so far, and more until fewer than ``below`` are in
        flight, reporting each; a part that failed for good raises here."""
        while self._pending:
            blocking = len(self._pending) >= below
            finished, self._pending = wait(
                self._pending, timeout=None if blocking else 0, return_when=FIRST_COMPLETED
            )
            if not finished:
                return
            for future in finished:
                entry, size = future.result()
                self._done.append(entry)
                self._on_part(size)

    def submit(self, part: _Part) -> None:
        number = len(self.part_crcs) + 1
        if number > MAX_PARTS:
            raise StorageError(
                f"object needs more than {MAX_PARTS} parts of {self._client.part_size} bytes; "
                "raise the tier's part_size",
                key=self._key,
                tier=self._client.label,
            )
        self.part_crcs.append(part.crc)
        stored = self._stored.pop(number, None)
        if stored is not None and part.held_by(stored):
            entry = {"PartNumber": number, "ETag": stored.etag, "ChecksumCRC32C": _checksum.encode(part.crc)}
            self._done.append(entry)
            self.reused += 1
            self._on_part(part.size)
            return
        self._pending.add(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: _Part) -> _Finished:
        client, encoded = self._client, _checksum.encode(part.crc)

        tries = 0

        def attempt() -> Any:
            nonlocal tries
            tries += 1
            if self._aborted or (self._stopping and tries > 1):  # abort()/stop() wait for this thread
                raise StorageError("multipart upload stopped", key=self._key, tier=client.label)
            return client.call(
                "upload_part",
                self._key,
                Key=self._full,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=part.body(),
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=encoded,
            )

        try:
            answer = client.retrying(f"upload part {number}", self._key, attempt)
        except StorageError as err:
            if client_error_code(err) != "NoSuchUpload" or self._stopping:
                raise
            # Another writer of this key (it resumed our upload, or we resumed its) completed
            # or aborted it, or gc did: its parts are gone, and this write can only start over.
            raise TransientStorageError(
                "the multipart upload is gone (completed or aborted elsewhere): the object is sent again",
                key=self._key,
                tier=client.label,
            ) from err
        return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32C": encoded}, part.size

    def complete(self, crc: int) -> None:
        self._settle(below=1)
        self._pool.shutdown()
        parts = sorted(self._done, key=lambda part: part["PartNumber"])
        extra: dict[str, Any] = {}
        if self._client.full_object_checksum:
            extra = {"ChecksumType": "FULL_OBJECT", "ChecksumCRC32C": _checksum.encode(crc)}
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                self._client.call(
                    "complete_multipart_upload",
                    self._key,
                    Key=self._full,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                    **extra,
                )
            except TierstoreError as err:
                # An earlier attempt may have completed it and lost the answer, or (at the
                # first attempt) another writer of this key that resumed the same upload
                # completed it: the verification that follows decides (design.md invariant 12).
                if client_error_code(err) != "NoSuchUpload":
                    raise
                self.vanished = tries == 1

        self._client.retrying("complete multipart upload", self._key, attempt)
        if self.reused:
            log.info(
                "completed %s in %s reusing %d of %d parts already stored",
                self._key,
                self._client.label,
                self.reused,
                len(parts),
            )

    def stop(self) -> None:
        """Stop sending parts once those in hand are sent (none is retried); the upload stays
        pending, with what S3 holds of it."""
        self._stopping = True
        self._pool.shutdown(wait=True, cancel_futures=self._aborted)  # submitted parts: in hand
        self._pending = set()

    def abort(self) -> None:
        """Stop the upload and free its parts; best effort, never raises."""
        self._aborted = True
        self.stop()
        try:
            self._client.abort_upload(self._key, self.upload_id)
        except Exception as err:  # an unaborted upload costs storage, not correctness
            log.warning(
                "could not abort multipart upload of %s in %s (its parts stay until "
                "garbage collection or a lifecycle rule removes them): %s",
                self._key,
                self._client.label,
                err,
            )


class _Part:
    """One part's bytes, held in the very ``BytesIO`` that goes out as the request body.

    botocore sends a ``BytesIO`` as it is and aiohttp streams it in small chunks; a
    ``bytes`` body would be wrapped in a shared ``BytesIO`` that aiohttp's
    ``getbuffer()`` then copies, doubling the memory of every part in flight.
    """

    def __init__(self, capacity: int = 0) -> None:
        self._body = io.BytesIO()
        if capacity:  # one exact allocation instead of repeated growth (writes past the end)
            self._body.seek(capacity - 1)
            self._body.write(b"\0")
            self._body.seek(0)
        self.size = 0
        self.crc = 0

    def add(self, piece: memoryview) -> None:
        self._body.write(piece)
        self.size += len(piece)
        self.crc = crc32c_update(self.crc, piece)

    def held_by(self, stored: StoredPart) -> bool:
        """Whether ``stored`` (a part S3 holds) holds this part's bytes."""
        with self._body.getbuffer() as view, view[: self.size] as body:
            return stored.holds(self.size, self.crc, body)

    def body(self) -> io.BytesIO:
        """The request body, rewound: each (re)try sends it from the start."""
        self._body.truncate(self.size)
        self._body.seek(0)
        return self._body


class S3ObjectWriter(ObjectWriter):
    """Streams one object to S3 (see the module docstring)."""

    def __init__(self, key: str, client: S3Client) -> None:
        super().__init__(key)
        self._client = client
        self._part = _Part()  # the first part grows: most objects are small
        self._upload: _MultipartUpload | None = None

    def _write(self, view: memoryview) -> None:
        part_size = self._client.part_size
        while view:
            if self._part.size >= part_size:
                self._ship_part()
            piece = view[: part_size - self._part.size]
            self._part.add(piece)
            view = view[len(piece) :]

    def _ship_part(self, *, last: bool = False) -> None:
        if self._upload is None:
            self._upload = _MultipartUpload(self._client, self.key, self._stored)
        # Wait for a free slot before starting the next part, so at most
        # max_concurrency + 1 parts exist (module docstring).
        self._upload.wait_for_slot()
        self._upload.submit(self._part)
        self._part = _Part(0 if last else self._client.part_size)

    def _commit(self) -> None:
        try:
            if self._upload is None:
                part, self._part = self._part, _Part()
                self._client.retrying(
                    "upload", self.key, lambda: self._client.put(self.key, part.body(), self.crc32c)
                )
                part_crcs: list[int] = []
            else:
                self._ship_part(last=True)
                self._upload.complete(self.crc32c)
                if self._upload.vanished:
                    self._found_completed()
                    return
                part_crcs = self._upload.part_crcs
            self._verify(part_crcs)
        except BaseException as err:
            if isinstance(err, TierstoreError) and not isinstance(err, TransientStorageError):
                self._discard()
            else:  # another try may cure it (or the process is going): keep the parts for it
                self._suspend()
            raise

    def _found_completed(self) -> None:
        """Our upload was completed by another writer of this key: the key must hold these
        bytes now (size and full-object CRC32C), or this write starts over. Nothing is
        deleted here: whatever the key holds was not stored by this write."""
        try:
            head = self._client.head(self.key)
        except ObjectNotFound:
            head = {}
        stored = _checksum.full_object_crc32c(head) if head else None
        if not head or int(head["ContentLength"]) != self.size or stored != self.crc32c:
            raise TransientStorageError(
                "the multipart upload was completed or aborted elsewhere, and the key does not "
                "hold these bytes: the object is sent again",
                key=self.key,
                tier=self._client.label,
            )
        self.version = _checksum.etag(head)

    def _verify(self, part_crcs: list[int]) -> None:
        """Size and stored CRC32C must be what we wrote (docs/design.md invariant 2)."""
        head = self._client.head(self.key)
        size = int(head["ContentLength"])
        if size != self.size:
            self._remove_bad(head)
            raise self._mismatch("size", f"{self.size} bytes", f"{size} bytes")
        stored = head.get("ChecksumCRC32C")
        if stored and stored not in _checksum.accepted_values(self.crc32c, part_crcs):
            self._remove_bad(head)
            raise self._mismatch("CRC32C", _checksum.encode(self.crc32c), stored)
        self.version = _checksum.etag(head)  # the very object this answer vouched for

    def _remove_bad(self, head: dict[str, Any]) -> None:
        """Delete the object S3 holds under our key with other bytes than we sent, but only
        that object (``If-Match`` its ETag): no good copy of anything has its size or CRC32C,
        and a good copy another migrator puts there meanwhile has another ETag and stays."""
        try:
            self._client.call(
                "delete_object", self.key, Key=self._client.full_key(self.key), IfMatch=head["ETag"]
            )
        except Exception as err:  # best effort: the mismatch is raised all the same
            log.warning("left a damaged upload %s in %s: %s", self.key, self._client.label, err)

    def _mismatch(self, what: str, expected: str, actual: str) -> ChecksumMismatch:
        return ChecksumMismatch(
            f"uploaded object's {what} differs: expected {expected}, S3 holds {actual}",
            key=self.key,
            tier=self._client.label,
            expected=expected,
            actual=actual,
        )

    def _discard(self) -> None:
        """Abort our multipart upload; never delete the key.

        An object under the key may be another migrator's verified copy of the same file
        (several migrators may upload one checkpoint at once), or ours, landed despite the
        error we got. S3 checks each PUT's CRC32C, so whatever is stored there holds these
        very bytes, or is a damaged object that a later upload replaces; no manifest vouches
        for it until it is checked in place (see tierstore.migrator). Deleting here is what
        let a throttled second migrator remove a committed object.
        """
        self._abort()

    def _abort(self) -> None:
        self._part = _Part()
        if self._upload is not None:
            self._upload.abort()

    def _suspend(self) -> None:
        self._part = _Part()
        if self._upload is not None:
            self._upload.stop()
