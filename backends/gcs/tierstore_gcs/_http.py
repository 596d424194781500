"""One HTTP request to the GCS JSON API, over gcsfs's credentials, endpoint and session.

Nothing here retries. gcsfs's own request loop (six attempts, sleeps of up to 32 s) is
bypassed on purpose: :mod:`tierstore.retry` is the one place retry policy lives, and the
backend retries whole idempotent units through it. From gcsfs we take what is worth
reusing: credential handling (``token=`` in every form gcsfs accepts, refresh), endpoint
resolution (``endpoint_url``, ``STORAGE_EMULATOR_HOST``, universe domain, mTLS) and its
aiohttp session on fsspec's I/O loop.

Request headers (credentials) and resumable-session URLs (bearer capabilities for their
upload) never reach a log line or an error message.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from fsspec.asyn import sync
from gcsfs.core import GCSFileSystem

__all__ = ["Buffer", "ClientBuildError", "Response", "Transport"]

Buffer = bytes | bytearray | memoryview

_SEND_STEP = 256 << 10  # bodies go out in slices, so the event loop never blocks on one
# Defaults; GCSBackend(connect_timeout=, read_timeout=) sets them per tier. A stalled server
# holds a request (and the migrator thread sending it) for up to read_timeout per attempt.
CONNECT_TIMEOUT, READ_TIMEOUT = 30.0, 120.0


class ClientBuildError(Exception):
    """gcsfs could not build a client from the options (a bad ``token=``, say)."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes | bytearray

    def json(self) -> dict[str, Any]:
        value = json.loads(self.body) if self.body else {}
        return value if isinstance(value, dict) else {}


class Transport:
    """Sends single requests; safe to share between threads and rebuilt after a fork."""

    def __init__(
        self,
        fs_options: Mapping[str, Any],
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self._fs_options = dict(fs_options)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._fs: GCSFileSystem | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _filesystem(self) -> GCSFileSystem:
        with self._lock:
            # A client built before a fork is bound to the parent's event loop.
            if self._fs is None or self._pid != os.getpid():
                try:
                    self._fs = GCSFileSystem(**self._fs_options, skip_instance_cache=True)
                except Exception as err:
                    # Not chained: gcsfs checks a raw token by sending it to Google in a
                    # URL, and a failure there prints that URL, token included.
                    raise ClientBuildError(type(err).__name__) from None
                self._pid = os.getpid()
            return self._fs

    def endpoint(self) -> str:
        """Where requests go: ``endpoint_url``, else ``STORAGE_EMULATOR_HOST``, else Google."""
        return str(self._filesystem()._location)

    def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Sequence[Buffer] = (),
    ) -> Response:
        """``url``: absolute (a session URL), or a path on the endpoint gcsfs resolved
        (``endpoint_url``, else ``STORAGE_EMULATOR_HOST``, else Google)."""
        fs = self._filesystem()
        if url.startswith("/"):
            url = str(fs._location).rstrip("/") + url
        response: Response = sync(
            fs.loop, _send, fs, method, url, dict(params or {}), dict(headers or {}), body, self._timeout
        )
        return response

    def close(self) -> None:
        with self._lock:
            fs, self._fs = self._fs, None
        session = getattr(fs, "_session", None) if fs is not None else None
        if fs is not None and session is not None and self._pid == os.getpid():
            sync(fs.loop, session.close)


async def _send(
    fs: GCSFileSystem,
    method: str,
    url: str,
    params: dict[str, str],
    headers: dict[str, str],
    body: Sequence[Buffer],
    timeout: aiohttp.ClientTimeout,
) -> Response:
    session = await fs._set_session()
    # identity: lengths we check are the bytes stored, never a compressed transfer.
    headers.setdefault("Accept-Encoding", "identity")
    headers = fs._get_headers(headers)  # adds (and refreshes) credentials
    size = sum(memoryview(part).nbytes for part in body)
    if body or method in ("POST", "PUT"):
        headers["Content-Length"] = str(size)
    data = _slices(body) if size else None
    async with session.request(
        method, url, params=params, headers=headers, data=data, timeout=timeout, allow_redirects=False
    ) as response:
        content = await _read_body(response)
        return Response(response.status, response.headers.copy(), content)


async def _slices(parts: Sequence[Buffer]) -> AsyncIterator[memoryview]:
    """The body as zero-copy slices (aiohttp warns on, and blocks the loop for, big bytes)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), _SEND_STEP):
            yield view[start : start + _SEND_STEP]


async def _read_body(response: aiohttp.ClientResponse) -> bytes | bytearray:
    length = response.content_length
    if length is None:
        return await response.read()
    # Fill one buffer of the announced length: a ranged read holds one copy, not two.
    buffer = bytearray(length)
    view = memoryview(buffer)
    filled = 0
    async for chunk in response.content.iter_any():
        if filled + len(chunk) > length:
            raise aiohttp.ClientPayloadError("response body longer than its Content-Length")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != length:
        raise aiohttp.ClientPayloadError(f"response body truncated at {filled} of {length} bytes")
    return buffer
