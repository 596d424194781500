"""Translate what s3fs/botocore/aiohttp raise into the tierstore error tree.

Transient (retried by :mod:`tierstore.retry`): throttling (503 SlowDown, 429), 5xx,
RequestTimeout, S3's 409 ConditionalRequestConflict, checksum failures of bytes in
transit, dropped or reset connections and timeouts. Not found: 404/NoSuchKey. A 412
precondition failure: :class:`PublishConflict`. Anything else (AccessDenied,
NoSuchBucket, bad credentials, bad parameters) is permanent. Messages carry the server's
code and message, never request parameters, so credentials cannot leak into them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from botocore import exceptions as boto
from botocore.parsers import ResponseParserError
from fsspec.exceptions import FSTimeoutError

from tierstore.errors import (
    ObjectNotFound,
    PublishConflict,
    StorageError,
    TierstoreError,
    TransientStorageError,
)

__all__ = ["translate", "client_error_code"]

try:  # aiobotocore's default HTTP stack; its errors may surface unwrapped
    from aiohttp import ClientConnectionError, ClientPayloadError

    _AIOHTTP: tuple[type[BaseException], ...] = (ClientConnectionError, ClientPayloadError)
except ImportError:  # pragma: no cover - aiobotocore with another HTTP backend
    _AIOHTTP = ()

_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeoutException",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "PriorRequestNotComplete",
    "IncompleteBody",
    # S3: a conditional write raced another one on the same key; retry to learn who won.
    "ConditionalRequestConflict",
    "OperationAborted",
    # The bytes arrived damaged in transit; resending the same bytes is the cure.
    "BadDigest",
    "XAmzContentSHA256Mismatch",
}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
# Transport failures: the request may or may not have reached the server.
_TRANSIENT_TRANSPORT: tuple[type[BaseException], ...] = (
    boto.EndpointConnectionError,
    boto.ConnectTimeoutError,
    boto.ProxyConnectionError,
    boto.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    boto.IncompleteReadError,
    ResponseParserError,  # throttling answers sometimes arrive as broken XML
    boto.ChecksumError,
    boto.FlexibleChecksumError,
    ConnectionError,  # builtin: resets, refusals, broken pipes
    TimeoutError,
    asyncio.TimeoutError,
    FSTimeoutError,
    *_AIOHTTP,
)


def _client_error(err: BaseException) -> boto.ClientError | None:
    """The botocore ``ClientError`` behind ``err`` (s3fs re-raises it as an OSError)."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, boto.ClientError):
            return seen
        seen = seen.__cause__
    return None


def _details(err: boto.ClientError) -> tuple[str, int, str]:
    response: dict[str, Any] = getattr(err, "response", None) or {}
    error = response.get("Error") or {}
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    code = str(error.get("Code") or status or "unknown")
    return code, status, str(error.get("Message") or "")


def client_error_code(err: BaseException) -> str | None:
    """The S3 error code of ``err`` (``"NoSuchUpload"``, ``"404"``...), if it has one."""
    client = _client_error(err)
    return _details(client)[0] if client is not None else None


def _from_client_error(err: boto.ClientError, key: str, tier: str) -> StorageError:
    code, status, message = _details(err)
    text = f"S3 {code} (HTTP {status}){': ' + message if message else ''}"
    if status == 412 or code == "PreconditionFailed":
        return PublishConflict(f"object already exists: {text}", key=key, tier=tier)
    if code in _NOT_FOUND_CODES:
        return ObjectNotFound(f"no such object: {text}", key=key, tier=tier)
    if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
        return TransientStorageError(f"transient S3 failure, will retry: {text}", key=key, tier=tier)
    return StorageError(f"permanent S3 failure, not retried: {text}", key=key, tier=tier)


def translate(err: BaseException, *, key: str, tier: str) -> TierstoreError:
    """The tierstore error for ``err``, naming ``key`` and ``tier``; raise it ``from err``."""
    if isinstance(err, TierstoreError):
        return err
    client = _client_error(err)
    if client is not None:
        return _from_client_error(client, key, tier)
    what = f"{type(err).__name__}: {err}"
    if isinstance(err, boto.SSLError):  # a certificate problem does not heal by retrying
        return StorageError(f"permanent S3 failure, not retried: {what}", key=key, tier=tier)
    if isinstance(err, _TRANSIENT_TRANSPORT):
        return TransientStorageError(f"transient S3 failure, will retry: {what}", key=key, tier=tier)
    return StorageError(f"permanent S3 failure, not retried: {what}", key=key, tier=tier)
