"""The local backend's writes: a unique temporary beside the key, made durable and renamed
into place on ``close()`` (docs/design.md invariant 2), and the walked directories it holds.

Writes go to an unbuffered descriptor: a large buffer goes to ``os.write`` as it is, with no
copy in Python; only small writes are coalesced. With ``direct_io`` they bypass the page cache
(``O_DIRECT``) through a page-aligned staging buffer, where the filesystem allows it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable

from tierstore.storage import faults
from tierstore.storage.backend import ObjectWriter, translate_os_errors

__all__ = ["O_DIRECT", "Dirs", "LocalWriter", "fsync_dir", "unlink_quietly", "version"]

_SMALL_WRITE = 64 << 10  # coalesce torch.save's many small header writes
_BUFFER = 1 << 20
# O_DIRECT wants memory, file offset and length aligned to the logical block size (512 or
# 4096): stage into a page-aligned mmap and write it in large whole blocks.
_DIRECT_CHUNK = 8 << 20
_DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def fsync_dir(fd: int) -> None:
    # One call site per purpose: tests/crash/test_power_loss.py tells them apart by caller.
    os.fsync(fd)


def version(st: os.stat_result) -> str:
    """A file's version (storage/backend.py): a rewrite in place moves its nanosecond mtime,
    a file renamed over it has another inode."""
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def unlink_quietly(name: str, directory: int) -> bool:
    """Unlink ``name`` of ``directory``; False where it could not be (gone already...)."""
    try:
        os.unlink(name, dir_fd=directory)
    except OSError:
        return False
    return True


class Dirs:
    """Open descriptors of the root and of each directory down to a key's parent.

    ``fds[i + 1]`` is ``names[i]`` opened relative to ``fds[i]``, so every later step acts
    on the directories that were walked, whatever a path would resolve to now.
    """

    def __init__(self, fds: list[int], names: list[str]) -> None:
        self.fds = fds
        self.names = names

    @property
    def fd(self) -> int:
        return self.fds[-1]

    def prune_empty(self) -> None:
        """Remove the walked directories left empty, deepest first; never the root.

        ``rmdir`` of a name never follows a link, so nothing outside can be removed.
        """
        for parent, name in reversed(list(zip(self.fds, self.names))):
            try:
                os.rmdir(name, dir_fd=parent)
            except OSError:
                return

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in reversed(fds):
            try:
                os.close(fd)
            except OSError:
                pass


class LocalWriter(ObjectWriter):
    """Writes a unique temporary beside the key; ``close()`` fsyncs and renames it into place."""

    def __init__(
        self,
        key: str,
        dirs: Dirs,
        fd: int,
        tmp: str,
        base: str,
        label: str,
        *,
        fsync: bool,
        direct: bool,
        defer_dir_sync: bool,
        refused_direct_io: Callable[[OSError], None],
    ) -> None:
        super().__init__(key)
        self._dirs = dirs
        self._fd = fd
        self._tmp = tmp
        self._base = base
        self._label = label
        self._fsync = fsync
        self._refused_direct_io = refused_direct_io
        self._buffer = bytearray()
        self._direct = direct  # the descriptor is O_DIRECT: writes go through _staging
        self._staging: mmap.mmap | None = None
        self._staged = 0
        self._defer_dir_sync = defer_dir_sync

    def _drain(self, view: memoryview) -> None:
        faults.point("local.write")
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as err:
                if not (self._direct and err.errno == errno.EINVAL):
                    raise
                # O_DIRECT accepted at open but refused now (a short write left the offset
                # unaligned, or the filesystem only pretends): finish with ordinary writes.
                self._refused_direct_io(err)
                self._end_direct()
                continue
            view = view[written:]

    def _end_direct(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~O_DIRECT)
        self._direct = False

    def _write(self, view: memoryview) -> None:
        with translate_os_errors(self.key, self._label):
            if self._direct:
                view = self._stage(view)
                if not view:
                    return
            if len(view) < _SMALL_WRITE:
                self._buffer += view
                if len(self._buffer) < _BUFFER:
                    return
                view = memoryview(b"")
            if self._buffer:
                self._drain(memoryview(self._buffer))
                self._buffer.clear()
            self._drain(view)

    def _stage(self, view: memoryview) -> memoryview:
        """Copy ``view`` into the aligned buffer, writing each full one; return what is left
        if O_DIRECT was given up on the way (ordinary writes take it)."""
        if self._staging is None:
            # Anonymous and private: page aligned, backed only as far as it is touched.
            self._staging = mmap.mmap(-1, _DIRECT_CHUNK, flags=mmap.MAP_PRIVATE)
        with memoryview(self._staging) as staging:
            while view and self._direct:
                take = min(len(view), _DIRECT_CHUNK - self._staged)
                staging[self._staged : self._staged + take] = view[:take]
                self._staged += take
                view = view[take:]
                if self._staged == _DIRECT_CHUNK:
                    self._staged = 0
                    self._drain(staging)
        return view

    def _flush_staged(self) -> None:
        """Write what is staged: whole blocks direct, the unaligned tail without O_DIRECT."""
        if self._staging is None or not self._staged:
            return
        staged, self._staged = self._staged, 0
        whole = staged - staged % _DIRECT_ALIGN
        with memoryview(self._staging) as staging:
            if whole:
                self._drain(staging[:whole])
            if staged > whole:
                if self._direct:
                    self._end_direct()
                self._drain(staging[whole:staged])

    def _release_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                staging.close()
            except BufferError:
                pass  # a view is still held by a traceback: unmapped when it goes

    def _commit(self) -> None:
        # Durable before visible, and visible whole: file fsync, rename over the key, then
        # its directory's entry (docs/design.md invariant 2). A crash leaves the old object or
        # the new one under the key, and at worst a temporary for gc.
        # With defer_dir_sync the entry's fsync is left to sync_dirs, once per directory.
        with translate_os_errors(self.key, self._label):
            try:
                self._flush_staged()
                self._release_staging()
                if self._buffer:
                    self._drain(memoryview(self._buffer))
                    self._buffer.clear()
                if self._fsync:
                    os.fsync(self._fd)
                self.version = version(os.fstat(self._fd))  # a rename keeps inode and mtime
                fd, self._fd = self._fd, -1
                os.close(fd)
                os.replace(self._tmp, self._base, src_dir_fd=self._dirs.fd, dst_dir_fd=self._dirs.fd)
            except BaseException:
                self._abort()
                raise
            try:
                if self._fsync and not self._defer_dir_sync:
                    fsync_dir(self._dirs.fd)
            finally:
                self._dirs.close()

    def _abort(self) -> None:
        # The temporary only: an object already under the key is never touched.
        self._release_staging()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            if self._dirs.fds and unlink_quietly(self._tmp, self._dirs.fd):
                self._dirs.prune_empty()
        finally:
            self._dirs.close()
