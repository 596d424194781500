"""Copying checkpoint files between tiers, verified on both ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from tierstore.errors import ChecksumMismatch, ObjectNotFound
from tierstore.format.manifest import FileEntry
from tierstore.format.verified import open_verified, verify_file
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers.tier import Tier

__all__ = ["Throttle", "copy_file", "check_copy", "has_verified_copy", "verified_copy"]

Progress = Callable[[int], None]


class Throttle:
    """A cap of ``rate`` bytes per second across every thread that shares it (``None`` or 0:
    no cap); ``clock`` and ``sleep`` are injectable.

    Every chunk is charged before it is sent: it takes the next ``nbytes / rate`` seconds of
    one timeline the threads share, waits for that slot to begin, and is done only when the
    slot has ended (:meth:`sending` sleeps out what the send itself did not take). So n bytes
    take at least n / rate seconds, the last chunk paid like every other: charging each
    chunk's time to the next one left the last chunk free (a 6 MiB file, one 8 MiB chunk,
    went unthrottled). Idle time earns no credit: there is no burst.
    """

    def __init__(
        self,
        rate: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = clock()

    @contextmanager
    def sending(self, nbytes: int) -> Iterator[None]:
        """Send ``nbytes`` in the block: it starts in this chunk's slot and the block ends
        when the slot does."""
        if not self.rate:
            yield
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = end = start + nbytes / self.rate
        if start > now:
            self._sleep(start - now)
        yield
        left = end - self._clock()
        if left > 0:
            self._sleep(left)

    def consume(self, nbytes: int) -> None:
        """Charge ``nbytes`` sent outside any block: wait until they are paid for."""
        with self.sending(nbytes):
            pass


def copy_file(
    src: Tier,
    dst: Tier,
    name: str,
    attempt: str,
    entry: FileEntry,
    *,
    chunk_size: int = 8 << 20,
    throttle: Throttle | None = None,
    progress: Progress | None = None,
    sent: Progress | None = None,
) -> str | None:
    """Stream ``entry`` from ``src`` to ``dst``; durable and verified when it returns, with
    the version of the object stored (``None`` where the backend reports none).

    ``progress(n)`` counts bytes the destination acknowledged holding
    (:meth:`~tierstore.storage.backend.ObjectWriter.report_stored`): each part of a multipart
    or resumable upload as the store confirms it, else the whole file once the writer's
    ``close()`` stored it. A copy that fails takes back what it counted (``progress(-n)``), so
    a file copied again counts its bytes once. Bytes read from the source and handed to the
    writer are not stored yet (an object store buffers them), so they are reported only to
    ``sent(n)``, per chunk, which may raise to stop the copy.

    The source bytes are checked against the manifest (size, CRC32C) as they stream, so a
    file damaged in the source tier is never copied as if it were good (the write is aborted
    with the :class:`ChecksumMismatch` naming the source tier); the destination writer's
    ``close()`` makes the copy durable and checks what the destination stored. Any other
    failure suspends the write: what the destination acknowledged stays for the next copy
    of the file to reuse, checked against the source bytes (docs/design.md invariant 12).
    """
    src_key = src.file_key(name, attempt, entry.path)
    dst_key = dst.file_key(name, attempt, entry.path)
    # Reused across chunks, and no larger than the file needs (as verify_file's): zeroing
    # 8 MiB for a 4 KiB shard cost more than its whole copy.
    buffer = memoryview(bytearray(min(chunk_size, max(entry.size, 1 << 16))))
    counted = _Counted(progress)
    with open_verified(src.backend, src_key, entry, checkpoint=name, tier=src.label) as stream:
        writer = dst.backend.open_write(dst_key)
        writer.report_stored(counted)
        try:
            while n := stream.readinto(buffer):
                with throttle.sending(n) if throttle is not None else nullcontext():
                    writer.write(buffer[:n])  # writers copy what they keep
                if sent is not None:
                    sent(n)
                faults.point("transfer.after_chunk")
            stream.finish()
            writer.close()
        except BaseException as err:
            counted.take_back()
            if isinstance(err, ChecksumMismatch) and err.tier == src.label:
                writer.abort()  # the source is damaged: nothing of it is worth keeping
            else:
                writer.suspend()  # both no-ops once close() ran: the writer cleaned up itself
            raise
    return writer.version


class _Counted:
    """``progress``, remembering what it passed on: a failed copy takes it back."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.n = progress, 0

    def __call__(self, n: int) -> None:
        if self.progress is not None:
            self.progress(n)
        self.n += n  # after the call: a count the callback refused (by raising) is not kept

    def take_back(self) -> None:
        if self.n and self.progress is not None:
            try:
                self.progress(-self.n)
            except Exception:  # a callback that refuses (a stopped job): the copy's error wins
                pass
        self.n = 0


def has_verified_copy(
    tier: Tier, name: str, attempt: str, entry: FileEntry, *, chunk_size: int = 8 << 20
) -> bool:
    """Does ``tier`` already hold ``entry`` intact? Trusts a server CRC32C, else reads back."""
    return verified_copy(tier, name, attempt, entry, chunk_size=chunk_size) is not None


def verified_copy(
    tier: Tier, name: str, attempt: str, entry: FileEntry, *, chunk_size: int = 8 << 20
) -> ObjectInfo | None:
    """What :func:`check_copy` verified (its version too), ``None`` if no intact copy."""
    try:
        return check_copy(tier, name, attempt, entry, chunk_size=chunk_size)
    except (ObjectNotFound, ChecksumMismatch):
        return None


def check_copy(
    tier: Tier, name: str, attempt: str, entry: FileEntry, *, chunk_size: int = 8 << 20
) -> ObjectInfo:
    """Raise unless ``tier`` holds ``entry`` intact: :class:`ObjectNotFound`, or the
    :class:`ChecksumMismatch` of the one verified read; else return what was verified.
    Trusts a server CRC32C (the stat that reports it names the version too), else reads
    back, and then the version must be the same after the read as before it (an object
    replaced while it was read is not the one that was verified)."""
    key = tier.file_key(name, attempt, entry.path)
    info = tier.backend.stat(key)
    if info.size != entry.size:
        raise ChecksumMismatch.size(entry.size, info.size, checkpoint=name, file=entry.path, tier=tier.label)
    if info.crc32c is not None:
        if info.crc32c != entry.crc32c:
            raise ChecksumMismatch.crc32c(
                entry.crc32c, info.crc32c, checkpoint=name, file=entry.path, tier=tier.label
            )
        return info
    verify_file(tier.backend, key, entry, checkpoint=name, tier=tier.label, chunk_size=chunk_size)
    after = tier.backend.stat(key)
    if after.version != info.version:
        raise ChecksumMismatch(
            f"replaced while it was verified (version {info.version} became {after.version})",
            checkpoint=name,
            file=entry.path,
            tier=tier.label,
        )
    return info
