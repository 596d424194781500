"""Local POSIX backend: node-local NVMe, or a parallel filesystem (Lustre, GPFS)."""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

from tierstore import faults
from tierstore.backend import Backend, ObjectInfo, ObjectWriter, check_key, translate_os_errors
from tierstore.errors import ConfigError, PublishConflict, UnsafePath

__all__ = ["LocalBackend"]

log = logging.getLogger(__name__)

_SMALL_WRITE = 64 << 10  # coalesce torch.save's many small header writes
_BUFFER = 1 << 20
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Hard links give an exclusive, atomic publish; these errnos mean the filesystem has none.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _path_from_url(url: str) -> str:
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"not a local path or file:// URL: {url!r}")
    return os.path.abspath(unquote(parsed.path))


class _LocalWriter(ObjectWriter):
    def __init__(self, key: str, path: str, fd: int, backend: LocalBackend) -> None:
        super().__init__(key)
        self._path = path
        self._fd = fd
        self._backend = backend
        self._buffer = bytearray()

    def _drain(self, view: memoryview) -> None:
        faults.point("local.write")
        while view:
            view = view[os.write(self._fd, view) :]

    def _write(self, view: memoryview) -> None:
        with translate_os_errors(self.key, self._backend.label):
            if len(view) < _SMALL_WRITE:
                self._buffer += view
                if len(self._buffer) < _BUFFER:
                    return
                view = memoryview(b"")
            if self._buffer:
                self._drain(memoryview(self._buffer))
                self._buffer.clear()
            self._drain(view)

    def _commit(self) -> None:
        # Durable before visible as complete: file fsync, then its directory's entry
        # (DESIGN.md invariant 2).
        with translate_os_errors(self.key, self._backend.label):
            try:
                if self._buffer:
                    self._drain(memoryview(self._buffer))
                    self._buffer.clear()
                if self._backend.fsync:
                    os.fsync(self._fd)
            except BaseException:
                self._abort()
                raise
            os.close(self._fd)
            if self._backend.fsync:
                _fsync_dir(os.path.dirname(self._path))

    def _abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            os.unlink(self._path)
        except OSError:
            return
        self._backend._prune_empty_dirs(os.path.dirname(self._path))


class LocalBackend(Backend):
    """Objects are files under a root directory; publish is temp, fsync, link, fsync directory.

    ``fsync=False`` skips every fsync: only for throwaway data on tmpfs, never for
    checkpoints you intend to trust after a power loss.
    """

    scheme = "file"

    def __init__(self, url: str, *, fsync: bool = True, **options: Any) -> None:
        super().__init__(url, **options)
        if options:
            raise ConfigError(f"unknown options for a local tier: {sorted(options)}")
        self.root = _path_from_url(str(url))
        self.fsync = fsync

    # -- paths -------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key, tier=self.label))

    def _check_inside(self, key: str, path: str) -> None:
        # Reject symbolic links anywhere below the root (manifests must never lead a read
        # outside the checkpoint: DESIGN.md invariant 4). The root itself may be a link.
        expected = os.path.join(os.path.realpath(self.root), *key.split("/"))
        if os.path.realpath(path) != expected:
            raise UnsafePath("path leaves the tier root through a symbolic link",
                             key=key, tier=self.label)

    def _makedirs(self, directory: str) -> None:
        """Create ``directory`` and missing parents, each entry made durable."""
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            parent = os.path.dirname(directory)
            if parent == directory:
                break
            directory = parent
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if os.path.isdir(path):
                    continue  # another writer made it first
                if os.path.lexists(path):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "not a directory, but a key needs it as one", path
                    ) from None
                # Another writer made it and a concurrent delete already pruned it again:
                # report it as vanished so ``_create`` starts over.
                raise FileNotFoundError(errno.ENOENT, "directory vanished", path) from None
            if self.fsync:
                _fsync_dir(os.path.dirname(path))

    # -- contract ----------------------------------------------------------------------

    def _create(self, path: str, flags: int) -> int:
        """Create ``path`` exclusively, making its directories first.

        ``delete`` removes directories it leaves empty, so a concurrent delete can remove
        the directory between our ``makedirs`` and ``open``: make it again and retry.
        """
        for _ in range(10):
            try:  # either step fails with ENOENT if a directory vanished under it
                self._makedirs(os.path.dirname(path))
                return os.open(path, flags | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue
        self._makedirs(os.path.dirname(path))
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)

    def open_write(self, key: str) -> ObjectWriter:
        path = self._path(key)
        with translate_os_errors(key, self.label):
            self._check_inside(key, path)
            fd = self._create(path, os.O_WRONLY | _O_NOFOLLOW)
        return _LocalWriter(key, path, fd, self)

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        with translate_os_errors(key, self.label, reading=True):
            self._check_inside(key, path)
            # O_NONBLOCK: opening a FIFO planted in place of a file must not hang; it has
            # no effect on regular files.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafePath("not a regular file", key=key, tier=self.label)
            return os.fdopen(fd, "rb")

    def publish(self, key: str, data: bytes) -> None:
        path = self._path(key)
        directory, base = os.path.split(path)
        tmp = os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        with translate_os_errors(key, self.label):
            fd = self._create(tmp, os.O_WRONLY)
            try:
                faults.point("local.publish.write")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)  # e.g. ENOSPC: leave no temporary behind
                raise
            os.close(fd)
            faults.point("local.publish.after_temp_fsync")
            try:
                self._link_exclusive(key, tmp, path)
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            faults.point("local.publish.before_dir_fsync")
            if self.fsync:
                _fsync_dir(directory)

    def _link_exclusive(self, key: str, tmp: str, path: str) -> None:
        try:
            os.link(tmp, path)  # atomic, and fails if `path` exists: an exclusive rename
        except FileExistsError as err:
            raise PublishConflict("already published", key=key, tier=self.label) from err
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
            # No hard links here: fall back to rename, exclusive only against
            # non-concurrent writers. Logged so operators know.
            log.warning("%s has no hard links; publish of %s is not race-exclusive",
                        self.label, key)
            if os.path.lexists(path):
                raise PublishConflict("already published", key=key, tier=self.label) from err
            os.rename(tmp, path)

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        with translate_os_errors(key, self.label, reading=True):
            st = os.lstat(path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise UnsafePath("not a regular file", key=key, tier=self.label)
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        top = self._path(prefix.rstrip("/")) if prefix else self.root
        for directory, _dirs, files in os.walk(top, followlinks=False):
            rel_dir = os.path.relpath(directory, self.root)
            for name in files:
                rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                try:
                    st = os.lstat(os.path.join(directory, name))
                except FileNotFoundError:
                    continue  # deleted while listing
                if stat_mod.S_ISREG(st.st_mode):
                    yield ObjectInfo(key=rel, size=st.st_size, mtime=st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with translate_os_errors(key, self.label):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            self._prune_empty_dirs(os.path.dirname(path))

    def _prune_empty_dirs(self, directory: str) -> None:
        """Drop directories left empty, up to (not including) the root."""
        while directory != self.root and directory.startswith(self.root):
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = os.path.dirname(directory)

    def free_bytes(self) -> int | None:
        directory = self.root
        while not os.path.isdir(directory):
            directory = os.path.dirname(directory)
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize

    def local_path(self, key: str) -> str:
        return self._path(key)
