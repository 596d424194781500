"""GCS answers and transport failures, translated into the tierstore error tree.

404 is :class:`ObjectNotFound`, 412 :class:`PublishConflict`; 408, 429, 5xx, dropped
connections and timeouts are :class:`TransientStorageError` (what ``tierstore.retry``
retries); everything else, 401/403 included, is a permanent :class:`StorageError`.
Messages carry the operation, key and tier, never credentials or session URLs.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from google.auth import exceptions as auth_errors

from tierstore.errors import ObjectNotFound, PublishConflict, StorageError, TransientStorageError
from tierstore_gcs._http import Response

__all__ = ["is_transient_status", "status_error", "response_error", "exception_error"]

# A resumable session URL is a bearer capability for its upload: never show its id.
_SESSION_ID = re.compile(r"(upload_id=)[^&\s'\"]+")
_MAX_DETAIL = 300


def _scrub(text: str) -> str:
    return _SESSION_ID.sub(r"\1<redacted>", text)[:_MAX_DETAIL]


def is_transient_status(status: int) -> bool:
    return status in (408, 429) or 500 <= status <= 599


def _server_message(response: Response) -> str:
    try:
        error = json.loads(response.body).get("error", {})
        message = error.get("message", "") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = bytes(response.body[:_MAX_DETAIL]).decode("utf-8", "replace")
    return _scrub(str(message).strip())


def status_error(
    status: int, detail: str, *, what: str, key: str, tier: str, missing: str = "object"
) -> StorageError:
    """The error for an HTTP answer the caller did not expect.

    ``missing``: what a 404 means; only ``"object"`` makes it :class:`ObjectNotFound`
    (a missing bucket is a configuration problem, never an absent key).
    """
    text = f"{what}: HTTP {status}" + (f" ({detail})" if detail else "")
    if status == 404 and missing == "object":
        return ObjectNotFound(f"{text}: no such object", key=key, tier=tier)
    if status == 404:
        return StorageError(f"{text}: no such {missing}: permanent", key=key, tier=tier)
    if status == 412:
        return PublishConflict(f"{text}: object already exists", key=key, tier=tier)
    if is_transient_status(status):
        return TransientStorageError(f"{text}: transient, worth retrying", key=key, tier=tier)
    if status in (401, 403):
        text += ": permanent, check the credentials and the bucket's permissions"
    else:
        text += ": permanent"
    return StorageError(text, key=key, tier=tier)


def response_error(
    response: Response, *, what: str, key: str, tier: str, missing: str = "object"
) -> StorageError:
    return status_error(
        response.status, _server_message(response), what=what, key=key, tier=tier, missing=missing
    )


def _transient_exception(err: BaseException) -> bool:
    permanent = (aiohttp.InvalidURL, aiohttp.ClientConnectorCertificateError)
    if isinstance(err, permanent):
        return False
    return isinstance(
        err,
        (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            TimeoutError,
            ConnectionError,
            auth_errors.TransportError,
        ),
    )


def exception_error(err: BaseException, *, what: str, key: str, tier: str) -> StorageError:
    """The error for a request that got no HTTP answer (or failed to authenticate)."""
    code = getattr(err, "code", None)  # gcsfs's HttpError, raised by a failed token refresh
    if isinstance(code, int) and code >= 400:
        return status_error(code, _scrub(str(getattr(err, "message", ""))), what=what, key=key, tier=tier)
    detail = _scrub(f"{type(err).__name__}: {err}")
    if _transient_exception(err):
        return TransientStorageError(f"{what}: {detail}: transient, worth retrying", key=key, tier=tier)
    return StorageError(f"{what}: {detail}: permanent", key=key, tier=tier)
