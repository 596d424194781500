"""The one verified read: a file a manifest lists, streamed from a tier and checked as it goes.

Every read that trusts stored checkpoint bytes goes through :class:`VerifiedStream`: the DCP
reader (bytes into torch), scrub (bytes discarded), transfer (bytes written to another tier,
and the read-back of an existing copy). Each byte is CRC32C'd as it streams by, skipped ones
included; :meth:`VerifiedStream.finish` then holds the total size and CRC32C to the
manifest's :class:`FileEntry` and raises :class:`ChecksumMismatch` in one format naming
file, checkpoint and tier, whichever caller found the damage (docs/design.md invariant 5).

Verification ends at ``finish()``: a caller acting on bytes before it (torch deserializing a
chunk, a writer storing it) must be ready to undo that when ``finish()`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from tierstore.errors import ChecksumMismatch
from tierstore.format.manifest import FileEntry
from tierstore.storage.backend import Backend
from tierstore.storage.checksum import crc32c_update

__all__ = ["CHUNK", "VerifiedStream", "open_verified", "verify_file"]

CHUNK = 8 << 20


class VerifiedStream:
    """Reads one file sequentially, counting and checksumming every byte that passes."""

    def __init__(self, raw: BinaryIO, entry: FileEntry, *, checkpoint: str | None, tier: str | None) -> None:
        self._raw = raw
        self.entry = entry
        self.checkpoint = checkpoint
        self.tier = tier
        self.pos = 0
        self.crc = 0

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; ``b""`` at the end of the stored file."""
        data = self._raw.read(n)
        self.crc = crc32c_update(self.crc, data)
        self.pos += len(data)
        return data

    def readinto(self, buffer: memoryview) -> int:
        """Fill ``buffer`` (reused by the caller: no allocation per chunk); 0 at the end."""
        readinto = getattr(self._raw, "readinto", None)
        if readinto is not None:
            n = int(readinto(buffer) or 0)
        else:
            chunk = self._raw.read(len(buffer))
            n = len(chunk)
            buffer[:n] = chunk
        self.crc = crc32c_update(self.crc, buffer[:n])
        self.pos += n
        return n

    def read_exactly(self, n: int) -> bytes:
        """``n`` bytes, or the size mismatch of a file that ends first."""
        data = self.read(n)
        if len(data) != n:
            self._drain()  # report the stored size, not where this read stopped
            raise self.size_mismatch()
        return data

    def skip_to(self, offset: int) -> None:
        """Read (and checksum) up to ``offset``, which must not be behind :attr:`pos`."""
        while self.pos < offset:
            if not self.read(min(CHUNK, offset - self.pos)):
                raise self.size_mismatch()

    def finish(self) -> None:
        """Read what is left; raise unless size and CRC32C equal the manifest's."""
        self._drain()
        if self.pos != self.entry.size:
            raise self.size_mismatch()
        if self.crc != self.entry.crc32c:
            raise ChecksumMismatch.crc32c(
                self.entry.crc32c, self.crc, checkpoint=self.checkpoint, file=self.entry.path, tier=self.tier
            )

    def size_mismatch(self) -> ChecksumMismatch:
        return ChecksumMismatch.size(
            self.entry.size, self.pos, checkpoint=self.checkpoint, file=self.entry.path, tier=self.tier
        )

    def _drain(self) -> None:
        while self.read(CHUNK):
            pass


@contextmanager
def open_verified(
    backend: Backend, key: str, entry: FileEntry, *, checkpoint: str | None, tier: str | None
) -> Iterator[VerifiedStream]:
    """Open ``key`` in ``backend`` as the stored copy of ``entry``; call ``finish()`` at the end."""
    with backend.open_read(key) as raw:
        yield VerifiedStream(raw, entry, checkpoint=checkpoint, tier=tier)


def verify_file(
    backend: Backend,
    key: str,
    entry: FileEntry,
    *,
    checkpoint: str | None,
    tier: str | None,
    chunk_size: int = CHUNK,
    progress: Callable[[int], None] | None = None,
    inspect: Callable[[int, memoryview], None] | None = None,
) -> None:
    """Read ``key`` through and discard it; raise :class:`ChecksumMismatch` unless intact.

    ``inspect(offset, data)`` sees every chunk read, in order, before the file is known to
    be intact (scrub checks the raw encoding's block checksums in the same pass with it).
    """
    # Small files get a small buffer; a file longer than its entry still streams in 64 KiB reads.
    buffer = memoryview(bytearray(min(chunk_size, max(entry.size, 1 << 16))))
    with open_verified(backend, key, entry, checkpoint=checkpoint, tier=tier) as stream:
        while n := stream.readinto(buffer):
            if inspect is not None:
                inspect(stream.pos - n, buffer[:n])
            if progress is not None:
                progress(n)
        stream.finish()
