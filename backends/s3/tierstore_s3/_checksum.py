"""CRC32C in S3's wire form, and what S3 may report back for an object.

S3 carries a CRC32C as base64 of its 4 big-endian bytes. A multipart object reports either
a FULL_OBJECT checksum (the CRC32C of all its bytes) or a COMPOSITE one: the CRC32C of the
concatenated binary part checksums, shown with a ``-<parts>`` suffix.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from tierstore.storage.backend import crc32c_update

__all__ = ["encode", "decode", "composite", "accepted_values", "full_object_crc32c", "etag"]


def encode(crc: int) -> str:
    return base64.b64encode(struct.pack(">I", crc & 0xFFFFFFFF)).decode("ascii")


def decode(value: str) -> int | None:
    """The CRC32C of a full-object checksum value, or ``None`` if it is not one."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int(struct.unpack(">I", raw)[0]) if len(raw) == 4 else None


def composite(part_crcs: Sequence[int]) -> str:
    """S3's COMPOSITE checksum of a multipart object, without the ``-N`` suffix."""
    joined = b"".join(struct.pack(">I", crc) for crc in part_crcs)
    return encode(crc32c_update(0, joined))


def accepted_values(full: int, part_crcs: Sequence[int]) -> set[str]:
    """Every checksum value S3 may truthfully report for an object we uploaded.

    Servers differ in which form they report for multipart objects (moto, for one,
    reports a composite value without its ``-N`` suffix); any of them proves the server
    holds the bytes whose CRC32Cs we computed.
    """
    values = {encode(full)}
    if part_crcs:
        combined = composite(part_crcs)
        values |= {combined, f"{combined}-{len(part_crcs)}"}
    return values


def full_object_crc32c(head: Mapping[str, Any]) -> int | None:
    """The CRC32C of the whole object from a HeadObject answer, if the server gave one.

    A composite checksum (``ChecksumType`` COMPOSITE, a ``-N`` suffix, or, where the
    type is not reported, a multipart ``-N`` ETag) says nothing about the bytes' CRC32C.
    """
    value = head.get("ChecksumCRC32C")
    if not value:
        return None
    kind = head.get("ChecksumType")
    if kind is not None and kind != "FULL_OBJECT":
        return None
    if kind is None and "-" in str(head.get("ETag", "")).strip('"'):
        return None
    return decode(str(value))


def etag(answer: Mapping[str, Any]) -> str | None:
    """An object's ETag (HEAD or listing), unquoted: its version in the backend contract."""
    value = str(answer.get("ETag") or "").strip('"')
    return value or None
