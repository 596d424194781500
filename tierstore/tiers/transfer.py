"""Copying checkpoint files between tiers, verified on both ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from tierstore.commit.manifest import FileEntry
from tierstore.errors import ChecksumMismatch, ObjectNotFound
from tierstore.storage import faults
from tierstore.storage.backend import crc32c_update
from tierstore.tiers.tier import Tier

__all__ = ["Throttle", "copy_file", "has_verified_copy"]

Progress = Callable[[int], None]


class Throttle:
    """A token bucket capping bytes per second across every thread that shares it."""

    def __init__(self, rate: float | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = clock()

    def consume(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
            delay = start - now
        if delay > 0:
            self._sleep(delay)


def copy_file(src: Tier, dst: Tier, name: str, attempt: str, entry: FileEntry, *,
              chunk_size: int = 8 << 20, throttle: Throttle | None = None,
              progress: Progress | None = None) -> None:
    """Stream ``entry`` from ``src`` to ``dst``; durable and verified when it returns.

    The source bytes are checked against the manifest (size, CRC32C) as they stream, so a
    file damaged in the source tier is never copied as if it were good; the destination
    writer's ``close()`` makes the copy durable and checks what the destination stored.
    """
    src_key = src.file_key(name, attempt, entry.path)
    dst_key = dst.file_key(name, attempt, entry.path)
    buffer = memoryview(bytearray(chunk_size))  # reused: no allocation per chunk
    with src.backend.open_read(src_key) as stream:
        writer = dst.backend.open_write(dst_key)
        try:
            while n := _read_into(stream, buffer):
                if throttle is not None:
                    throttle.consume(n)
                writer.write(buffer[:n])  # writers copy what they keep
                if progress is not None:
                    progress(n)
                faults.point("transfer.after_chunk")
            if (writer.size, writer.crc32c) != (entry.size, entry.crc32c):
                raise ChecksumMismatch(
                    f"source copy does not match the manifest (size {writer.size}, crc32c "
                    f"{writer.crc32c:08x}; expected {entry.size}, {entry.crc32c:08x})",
                    checkpoint=name, file=entry.path, tier=src.label,
                    expected=f"{entry.crc32c:08x}", actual=f"{writer.crc32c:08x}",
                )
        except BaseException:
            writer.abort()
            raise
        writer.close()


def _read_into(stream: BinaryIO, buffer: memoryview) -> int:
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        return int(readinto(buffer) or 0)
    chunk = stream.read(len(buffer))
    buffer[: len(chunk)] = chunk
    return len(chunk)


def has_verified_copy(tier: Tier, name: str, attempt: str, entry: FileEntry, *,
                      chunk_size: int = 8 << 20) -> bool:
    """Does ``tier`` already hold ``entry`` intact? Trusts a server CRC32C, else reads back."""
    key = tier.file_key(name, attempt, entry.path)
    try:
        info = tier.backend.stat(key)
    except ObjectNotFound:
        return False
    if info.size != entry.size:
        return False
    if info.crc32c is not None:
        return info.crc32c == entry.crc32c
    crc = 0
    with tier.backend.open_read(key) as stream:
        while chunk := stream.read(chunk_size):
            crc = crc32c_update(crc, chunk)
    return crc == entry.crc32c
