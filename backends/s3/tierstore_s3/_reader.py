"""Streaming reads: consecutive ranged GETs of ``part_size`` bytes, one fetched ahead.

Each range is fetched whole before any of it is handed out, so a failed range is retried
as an idempotent unit, never resumed halfway (docs/design.md, Conventions). Every range is pinned to the
ETag seen when the stream was opened: an object replaced mid-read fails loudly instead of
splicing two objects together.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, BinaryIO

from tierstore.errors import PublishConflict, StorageError, TransientStorageError
from tierstore_s3._errors import translate

if TYPE_CHECKING:
    from tierstore_s3._client import S3Client

__all__ = ["open_ranged"]

_BUFFER = 256 << 10  # for the many small reads of pickle and torch.load
_CHUNK = 1 << 20


class _RangedReader(io.RawIOBase):
    def __init__(self, client: S3Client, key: str, size: int, etag: str | None) -> None:
        super().__init__()
        self._client = client
        self._key = key
        self._full = client.full_key(key)
        self._size = size
        self._etag = etag
        self._view = memoryview(b"")
        self._fetched = 0  # where the next range starts
        self._ahead: Future[bytearray] | None = self._start(0) if size else None

    def readable(self) -> bool:
        return True

    def _end(self, start: int) -> int:
        return min(start + self._client.part_size, self._size)

    async def _get(self, start: int, end: int) -> bytearray:
        conditions = {"IfMatch": self._etag} if self._etag else {}
        # fsspec's async API is its underscore-named coroutines: run on s3fs's loop, a
        # range can be fetched ahead without a thread of its own.
        answer = await self._client.fs._call_s3(
            "get_object",
            Bucket=self._client.bucket,
            Key=self._full,
            Range=f"bytes={start}-{end - 1}",
            **conditions,
        )
        # Fill one exact buffer: body.read() would join a list of chunks, briefly holding
        # the range twice.
        data = bytearray(end - start)
        filled = 0
        async with answer["Body"] as body:
            async for chunk in body.iter_chunks(_CHUNK):
                if filled + len(chunk) > len(data):
                    filled += len(chunk)
                    break
                data[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
        if filled != len(data):
            raise TransientStorageError(
                f"range of bytes {start}-{end - 1} came back with {filled} bytes",
                key=self._key,
                tier=self._client.label,
            )
        return data

    def _start(self, start: int) -> Future[bytearray]:
        coroutine = self._get(start, self._end(start))
        return asyncio.run_coroutine_threadsafe(coroutine, self._client.fs.loop)

    def _result(self, future: Future[bytearray]) -> bytearray:
        try:
            return future.result()
        except Exception as err:
            failure = translate(err, key=self._key, tier=self._client.label)
            if isinstance(failure, PublishConflict):  # the If-Match pin failed
                failure = StorageError(
                    "object changed while being read", key=self._key, tier=self._client.label
                )
            if failure is err:
                raise
            raise failure from err

    def _next_range(self) -> bytearray:
        start = self._fetched
        ahead, self._ahead = self._ahead, None

        def attempt() -> bytearray:
            nonlocal ahead
            future, ahead = ahead or self._start(start), None
            return self._result(future)

        what = f"read of bytes {start}-{self._end(start) - 1}"
        data = self._client.retrying(what, self._key, attempt)
        self._fetched = self._end(start)
        if self._fetched < self._size:
            self._ahead = self._start(self._fetched)
        return data

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        if not self._view:
            if self._fetched >= self._size:
                return 0
            self._view = memoryview(self._next_range())
        n = min(len(out), len(self._view))
        out[:n] = self._view[:n]
        self._view = self._view[n:]
        return n

    def readall(self) -> bytes:
        pieces: list[bytes | bytearray] = [bytes(self._view)]
        self._view = memoryview(b"")
        while self._fetched < self._size:
            pieces.append(self._next_range())
        return b"".join(pieces)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None
        self._view = memoryview(b"")
        super().close()


def open_ranged(client: S3Client, key: str, head: dict[str, Any]) -> BinaryIO:
    """A buffered stream over ``key``, whose HeadObject answer is ``head``."""
    raw = _RangedReader(client, key, int(head["ContentLength"]), head.get("ETag"))
    return io.BufferedReader(raw, buffer_size=_BUFFER)
