"""What goes on the wire: tier URLs, object names, CRC32C encoding, multipart bodies, times."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from datetime import datetime
from typing import Any

from tierstore.errors import ConfigError, StorageError
from tierstore.storage.backend import check_key
from tierstore_gcs._http import Buffer

__all__ = ["PART_QUANTUM", "parse_url", "encode_crc32c", "decode_crc32c", "multipart_body", "parse_time"]

PART_QUANTUM = 256 << 10  # every resumable-upload chunk but the last is a multiple of this

# Bucket names: 3-63 characters (up to 222 with dots), lowercase letters, digits, - _ .
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_SCHEMES = ("gs", "gcs")


def parse_url(url: str) -> tuple[str, str]:
    """``gs://bucket[/prefix]`` (or ``gcs://``) -> ``(bucket, prefix)``, prefix without slashes."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ConfigError(f"not a GCS URL (gs://bucket[/prefix]): {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"invalid GCS bucket name {bucket!r} in {url!r}")
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_key(prefix)  # the root itself must be a clean relative path
        except StorageError as err:
            raise ConfigError(f"invalid prefix {prefix!r} in GCS URL {url!r}") from err
    return bucket, prefix


def encode_crc32c(crc: int) -> str:
    """GCS's form: base64 of the big-endian 4 bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def decode_crc32c(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def multipart_body(name: str, data: Buffer, crc32c: int) -> tuple[str, list[Buffer]]:
    """Content-Type and body parts of a one-request upload of ``data`` as ``name``.

    The metadata names the CRC32C: GCS then refuses bytes damaged on the way
    (fake-gcs-server ignores it; the backend verifies the stored checksum either way).
    """
    boundary = f"tierstore-{uuid.uuid4().hex}"
    metadata = json.dumps({"name": name, "crc32c": encode_crc32c(crc32c)})
    head = (
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{metadata}\r\n"
        f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    return f'multipart/related; boundary="{boundary}"', [head, data, tail]


def parse_time(text: Any) -> float | None:
    """RFC 3339 (``2024-01-01T00:00:00.123Z``) -> POSIX seconds; ``None`` if unreadable."""
    if not isinstance(text, str):
        return None
    try:
        # Python 3.10's fromisoformat wants "+00:00", not "Z".
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
