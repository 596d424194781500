"""What an interrupted multipart upload of a key left, and which of its parts a new write reuses.

A writer killed mid-upload (or suspended: ``ObjectWriter.suspend``) leaves its upload pending,
with every part S3 acknowledged. The next write of the same key that needs a multipart
upload adopts the newest pending upload of that key (``ListMultipartUploads``) and lists its
parts (``ListParts``). As it fills each part from the bytes it is given, it reuses the stored
part of that number only if the part holds these very bytes: the same size, and the CRC32C
S3 lists for it (every part tierstore uploads carries one), or, where none is listed, the
ETag S3 gives a part: its MD5 (not under SSE-KMS or SSE-C, whose ETags are not MD5s; there
nothing is reused). Any other part is uploaded again over the stored one. The object is then
verified whole, as every upload is (docs/design.md invariant 2), so nothing stored is ever
trusted without being checked against the bytes being written.

Finding nothing to resume costs one request per multipart object. Where listing is refused
(no ``s3:ListBucketMultipartUploads`` permission) or fails, the write starts a new upload.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from tierstore.errors import TierstoreError
from tierstore_s3 import _checksum
from tierstore_s3._errors import client_error_code

if TYPE_CHECKING:
    from tierstore_s3._client import S3Client

__all__ = ["Pending", "StoredPart", "find_pending"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredPart:
    """One part of a pending upload, as ``ListParts`` shows it."""

    size: int
    etag: str  # as S3 gives it, quotes included: what CompleteMultipartUpload names
    crc32c: str | None  # base64, where S3 lists one

    def holds(self, size: int, crc: int, body: memoryview) -> bool:
        """Whether this part holds ``body`` (``size`` bytes of CRC32C ``crc``)."""
        if size != self.size:
            return False
        if self.crc32c is not None:
            return self.crc32c == _checksum.encode(crc)
        return self.etag.strip('"') == hashlib.md5(body, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Pending:
    """A pending multipart upload of one key and the parts it holds, by part number."""

    upload_id: str
    parts: dict[int, StoredPart]


def find_pending(client: S3Client, key: str) -> Pending | None:
    """The newest pending upload of ``key`` that a write with this client's checksum
    settings can complete, with its parts; ``None`` if there is none or S3 will not say."""
    try:
        for upload_id in _uploads_of(client, key):
            parts = _parts_of(client, key, upload_id)
            if parts is not None:
                log.info(
                    "resuming a multipart upload of %s in %s: %d parts stored, each checked "
                    "against the bytes before it is reused",
                    key,
                    client.label,
                    len(parts),
                )
                return Pending(upload_id, parts)
    except TierstoreError as err:  # no permission to list, or the store is down: start over
        log.debug("no resume of %s in %s: %s", key, client.label, err)
    return None


def _uploads_of(client: S3Client, key: str) -> list[str]:
    """Upload ids of ``key``'s pending uploads of our checksum kind, the newest first."""
    full = client.full_key(key)
    page = client.retrying(
        "list uploads", key, partial(client.call, "list_multipart_uploads", key, Prefix=full)
    )
    kind = "FULL_OBJECT" if client.full_object_checksum else "COMPOSITE"
    found = [
        upload
        for upload in page.get("Uploads", [])
        if upload.get("Key") == full
        and upload.get("ChecksumAlgorithm") in (None, "CRC32C")
        and upload.get("ChecksumType") in (None, kind)
    ]
    # Newest first; listing order breaks ties (moto gives every upload one Initiated time).
    ordered = sorted(enumerate(found), key=lambda item: (_started(item[1]), item[0]), reverse=True)
    return [str(upload["UploadId"]) for _, upload in ordered]


def _started(upload: dict[str, Any]) -> float:
    initiated = upload.get("Initiated")
    return initiated.timestamp() if initiated is not None else 0.0


def _parts_of(client: S3Client, key: str, upload_id: str) -> dict[int, StoredPart] | None:
    """Every part of the upload, ``None`` if it is gone (completed or aborted meanwhile)."""
    full = client.full_key(key)
    parts: dict[int, StoredPart] = {}
    marker: dict[str, Any] = {}
    while True:
        try:
            page = client.retrying(
                "list parts",
                key,
                partial(client.call, "list_parts", key, Key=full, UploadId=upload_id, **marker),
            )
        except TierstoreError as err:
            if client_error_code(err) == "NoSuchUpload":
                return None
            raise
        for part in page.get("Parts", []):
            parts[int(part["PartNumber"])] = StoredPart(
                int(part["Size"]), str(part["ETag"]), part.get("ChecksumCRC32C")
            )
        if not page.get("IsTruncated"):
            return parts
        marker = {"PartNumberMarker": page["NextPartNumberMarker"]}
