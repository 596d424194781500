"""Streaming reads: ranged GETs of one block each, pinned to the generation opened.

Each block is one retried unit (a whole ranged GET), so a dropped connection costs one
block, and a read never mixes bytes of two versions of an object.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from tierstore.errors import ObjectNotFound, StorageError

if TYPE_CHECKING:
    from tierstore_gcs._client import GCSClient

__all__ = ["RangeReader"]


class RangeReader(io.RawIOBase):
    def __init__(self, client: GCSClient, key: str, size: int, generation: str, block_size: int) -> None:
        super().__init__()
        self._client = client
        self._key = key
        self._size = size
        self._generation = generation
        self._block_size = block_size
        self._pos = 0
        self._block: bytes | bytearray = b""
        self._block_start = 0

    def readable(self) -> bool:
        return True

    def _fetch(self) -> None:
        self._block = b""  # hold one block at a time, not two
        stop = min(self._pos + self._block_size, self._size)
        try:
            self._block = self._client.read_range(self._key, self._generation, self._pos, stop)
        except ObjectNotFound as err:
            # The generation we opened is gone: the key was replaced or deleted mid-read. Say
            # so, rather than "no such object" for a key that may well exist (as S3 does).
            raise StorageError(
                "object changed while being read", key=self._key, tier=self._client.label
            ) from err
        self._block_start = self._pos

    def readinto(self, buffer: Any) -> int:
        if self.closed:
            raise ValueError("read from a closed GCS object stream")
        view = memoryview(buffer).cast("B")
        if not len(view) or self._pos >= self._size:
            return 0
        if self._pos >= self._block_start + len(self._block):
            self._fetch()
        offset = self._pos - self._block_start
        n = min(len(view), len(self._block) - offset)
        view[:n] = memoryview(self._block)[offset : offset + n]
        self._pos += n
        return n

    def readall(self) -> bytes:
        # RawIOBase's default reads 8 KiB at a time; take whole blocks instead.
        pieces = []
        while self._pos < self._size:
            if self._pos >= self._block_start + len(self._block):
                self._fetch()
            offset = self._pos - self._block_start
            pieces.append(memoryview(self._block)[offset:])
            self._pos = self._block_start + len(self._block)
        return b"".join(pieces)

    def close(self) -> None:
        self._block = b""
        super().close()
