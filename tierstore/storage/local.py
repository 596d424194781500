"""Local POSIX backend: node-local NVMe, or a parallel filesystem (Lustre, GPFS).

Every operation below the root goes through directory file descriptors opened one
component at a time with ``O_NOFOLLOW | O_DIRECTORY``, and acts on the last name relative
to its directory (``openat``, ``unlinkat``, ``linkat``, ``renameat``, ``mkdirat``). A
symbolic link anywhere below the root, even one swapped in after a check, therefore
cannot lead a read, write, publish, mkdir or delete outside the store: the walk refuses it
with :class:`~tierstore.errors.UnsafePath` (docs/design.md invariant 7). The root itself may be
a symbolic link.

Writes go to an unbuffered descriptor: a large buffer goes to ``os.write`` as it is, with no
copy in Python; only small writes are coalesced. With ``direct_io`` they bypass the page cache
(``O_DIRECT``) through a page-aligned staging buffer, where the filesystem allows it.

A delete unlinks, and every write creates a new file: a deleted file's space goes back to the
filesystem, and its bytes stay those of whoever still holds it (docs/design.md invariant 24).

Why one module of about 600 lines: it is one backend, and its guarantees (fsync of files and
directories, link-based exclusive publish, no symlink followed, versions from inode, size and
mtime) hold only together; split, the contract it meets would be spread over files.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import threading
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

from tierstore.errors import ConfigError, PublishConflict, UnsafePath
from tierstore.storage import faults
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key, translate_os_errors
from tierstore.storage.local_writer import O_DIRECT as _O_DIRECT
from tierstore.storage.local_writer import Dirs as _Dirs
from tierstore.storage.local_writer import LocalWriter
from tierstore.storage.local_writer import fsync_dir as _fsync_dir
from tierstore.storage.local_writer import unlink_quietly as _unlink_quietly
from tierstore.storage.local_writer import version as _version

__all__ = ["LocalBackend"]

log = logging.getLogger(__name__)

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
# Hard links give an exclusive, atomic publish; these errnos mean the filesystem has none.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}
# A directory a writer just made or opened can be pruned by a concurrent delete before the
# writer creates its file there (ENOENT): start over this many times.
_VANISHED_RETRIES = 10


def _temp_name(base: str) -> str:
    # gc recognises ".tmp-" debris; the leading dot keeps it out of DCP's shard names.
    return f".{base}.tmp-{uuid.uuid4().hex[:12]}"


def _path_from_url(url: str) -> str:
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"not a local path or file:// URL: {url!r}")
    return os.path.abspath(unquote(parsed.path))


class LocalBackend(Backend):
    """Objects are files under a root directory; publish is temp, fsync, link, fsync directory.

    ``fsync=False`` skips every fsync: only for throwaway data on tmpfs, never for
    checkpoints you intend to trust after a power loss. ``direct_io=True`` writes objects
    with ``O_DIRECT`` (NVMe: no page-cache copy, no dirty-page writeback); where the
    filesystem refuses it, writes fall back to ordinary ones, logged once per backend.
    """

    scheme = "file"

    def __init__(
        self,
        url: str,
        *,
        fsync: bool = True,
        direct_io: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        if options:
            raise ConfigError(f"unknown options for a local tier: {sorted(options)}")
        self.root = _path_from_url(str(url))
        self.fsync = fsync
        self.direct_io = bool(direct_io and _O_DIRECT)
        self._direct_lock = threading.Lock()

    def _refused_direct_io(self, err: OSError) -> None:
        """The filesystem refused O_DIRECT: stop asking for it, and say so once."""
        with self._direct_lock:
            first, self.direct_io = self.direct_io, False
        if first:
            log.warning(
                "%s refuses O_DIRECT (%s); writing through the page cache instead", self.label, err.strerror
            )

    # -- walking below the root ------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key, tier=self.label))

    def _open_root(self, create: bool) -> int:
        flags = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC  # the root itself may be a link
        try:
            return os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                raise
        self._make_root()
        return os.open(self.root, flags)

    def _make_root(self) -> None:
        """Create the root and its missing parents (the configured place, not the store)."""
        missing, directory = [], self.root
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
                raise NotADirectoryError(
                    errno.ENOTDIR, "not a directory, but the tier root needs it as one", path
                ) from None
            if self.fsync:
                fd = os.open(os.path.dirname(path), os.O_RDONLY | _O_CLOEXEC)
                try:
                    _fsync_dir(fd)
                finally:
                    os.close(fd)

    def _refuse_link(self, key: str, parent: int, name: str) -> None:
        """Raise :class:`UnsafePath` if ``name`` in ``parent`` is a symbolic link."""
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return
        if stat_mod.S_ISLNK(st.st_mode):
            raise UnsafePath("symbolic link in key path", key=key, tier=self.label)

    def _makedirs(self, parent: int, name: str) -> None:
        """Make directory ``name`` in ``parent``, its entry durable; fine if it exists."""
        try:
            os.mkdir(name, 0o777, dir_fd=parent)
        except FileExistsError:
            return  # another writer made it first, or it is no directory: the open says
        if self.fsync:
            _fsync_dir(parent)

    def _open_dir(self, key: str, parent: int, name: str, create: bool) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
        except NotADirectoryError:
            self._refuse_link(key, parent, name)
            raise NotADirectoryError(
                errno.ENOTDIR, "not a directory, but a key needs it as one", name
            ) from None
        self._makedirs(parent, name)
        # ENOENT here: made by another writer and already pruned by a concurrent delete.
        return self._open_dir(key, parent, name, create=False)

    def _open_dirs(self, key: str, names: list[str], *, create: bool) -> _Dirs:
        """Walk from the root down ``names``, refusing links (making missing ones if ``create``)."""
        fds = [self._open_root(create)]
        dirs = _Dirs(fds, names)
        try:
            for name in names:
                fds.append(self._open_dir(key, fds[-1], name, create))
        except BaseException:
            dirs.close()
            raise
        return dirs

    def _create_file(self, name: str, directory: int, direct: bool) -> tuple[int, bool]:
        """Exclusively create ``name``, O_DIRECT if ``direct`` and the filesystem allows it."""
        if direct and self.direct_io:
            try:
                return os.open(name, _CREATE_FLAGS | _O_DIRECT, 0o644, dir_fd=directory), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                # Linux made the file before it found O_DIRECT unsupported (ramfs, some FUSE).
                _unlink_quietly(name, directory)
                self._refused_direct_io(err)
        return os.open(name, _CREATE_FLAGS, 0o644, dir_fd=directory), False

    def _create(self, key: str, parts: list[str], name: str, direct: bool = False) -> tuple[_Dirs, int, bool]:
        """Exclusively create file ``name`` in ``key``'s directory, making it first; say
        whether it is open for O_DIRECT. Always a new file, never one that was deleted
        (docs/design.md invariant 24).

        ``delete`` removes directories it leaves empty, so a concurrent delete can remove
        the directory between our walk and our create: walk again and retry.
        """
        for attempt in range(_VANISHED_RETRIES + 1):
            try:
                dirs = self._open_dirs(key, parts[:-1], create=True)
            except FileNotFoundError:
                if attempt == _VANISHED_RETRIES:
                    raise
                continue
            try:
                return (dirs, *self._create_file(name, dirs.fd, direct))
            except FileNotFoundError:
                dirs.close()
                if attempt == _VANISHED_RETRIES:
                    raise
            except BaseException:
                dirs.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- contract ----------------------------------------------------------------------

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        parts = check_key(key, tier=self.label)
        tmp = _temp_name(parts[-1])
        with translate_os_errors(key, self.label):
            dirs, fd, direct = self._create(key, parts, tmp, direct=True)
        return LocalWriter(
            key,
            dirs,
            fd,
            tmp,
            parts[-1],
            self.label,
            fsync=self.fsync,
            direct=direct,
            defer_dir_sync=defer_dir_sync,
            refused_direct_io=self._refused_direct_io,
        )

    def sync_dirs(self, keys: Iterable[str]) -> None:
        """fsync each distinct directory holding one of ``keys``, once.

        Directories a write created had their own entries made durable by ``_makedirs``
        then; a key's missing directory holds nothing of ours and is skipped.
        """
        if not self.fsync:
            return
        for names in sorted({tuple(check_key(key, tier=self.label)[:-1]) for key in keys}):
            where = "/".join(names) + "/" if names else ""
            with translate_os_errors(where, self.label):
                try:
                    dirs = self._open_dirs(where, list(names), create=False)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    _fsync_dir(dirs.fd)
                finally:
                    dirs.close()

    def open_read(self, key: str) -> BinaryIO:
        parts = check_key(key, tier=self.label)
        with translate_os_errors(key, self.label, reading=True):
            dirs = self._open_dirs(key, parts[:-1], create=False)
            try:
                # O_NONBLOCK: opening a FIFO planted in place of a file must not hang; it
                # has no effect on regular files. O_NOFOLLOW: a link fails with ELOOP.
                fd = os.open(
                    parts[-1], os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dirs.fd
                )
            finally:
                dirs.close()
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafePath("not a regular file", key=key, tier=self.label)
            return os.fdopen(fd, "rb")

    def publish(self, key: str, data: bytes) -> None:
        parts = check_key(key, tier=self.label)
        tmp = _temp_name(parts[-1])
        with translate_os_errors(key, self.label):
            dirs, fd, _ = self._create(key, parts, tmp)
            try:
                try:
                    faults.point("local.publish.write")
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if self.fsync:
                        os.fsync(fd)
                except BaseException:
                    os.close(fd)
                    _unlink_quietly(tmp, dirs.fd)  # e.g. ENOSPC: leave no temporary behind
                    raise
                os.close(fd)
                faults.point("local.publish.after_temp_fsync")
                try:
                    self._link_exclusive(key, dirs.fd, tmp, parts[-1])
                finally:
                    _unlink_quietly(tmp, dirs.fd)
                faults.point("local.publish.before_dir_fsync")
                if self.fsync:
                    _fsync_dir(dirs.fd)
            finally:
                dirs.close()

    def _link_exclusive(self, key: str, directory: int, tmp: str, base: str) -> None:
        try:  # atomic, and fails if `base` exists (even as a link): an exclusive rename
            os.link(tmp, base, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
        except FileExistsError as err:
            raise PublishConflict("already published", key=key, tier=self.label) from err
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
            # No hard links here: fall back to rename, exclusive only against
            # non-concurrent writers. Logged so operators know.
            log.warning("%s has no hard links; publish of %s is not race-exclusive", self.label, key)
            try:
                os.stat(base, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError:
                os.rename(tmp, base, src_dir_fd=directory, dst_dir_fd=directory)
                return
            raise PublishConflict("already published", key=key, tier=self.label) from err

    def stat(self, key: str) -> ObjectInfo:
        parts = check_key(key, tier=self.label)
        with translate_os_errors(key, self.label, reading=True):
            dirs = self._open_dirs(key, parts[:-1], create=False)
            try:
                st = os.stat(parts[-1], dir_fd=dirs.fd, follow_symlinks=False)
            finally:
                dirs.close()
        if not stat_mod.S_ISREG(st.st_mode):
            raise UnsafePath("not a regular file", key=key, tier=self.label)
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime, version=_version(st))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Regular files only: links, FIFOs and linked directories are no objects of ours."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        names = check_key(prefix.rstrip("/"), tier=self.label) if prefix else []
        try:
            dirs = self._open_dirs(prefix, names, create=False)
        except (FileNotFoundError, NotADirectoryError, UnsafePath):
            return  # nothing stored there, or only through a link
        try:
            yield from self._walk(dirs.fd, prefix)
        finally:
            dirs.close()

    def _walk(self, fd: int, rel: str) -> Iterator[ObjectInfo]:
        try:
            with os.scandir(fd) as scan:
                entries = list(scan)
        except OSError:
            return  # removed or unreadable while listing
        for entry in entries:
            key = rel + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if stat_mod.S_ISREG(st.st_mode):
                        yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime, version=_version(st))
                    continue
                else:
                    continue
            except OSError:
                continue  # deleted, or swapped for a link, while listing
            try:
                yield from self._walk(child, key + "/")
            finally:
                os.close(child)

    def delete(self, key: str) -> None:
        parts = check_key(key, tier=self.label)
        with translate_os_errors(key, self.label):
            try:
                dirs = self._open_dirs(key, parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return  # no such key
            try:
                try:
                    # Unlinked, never kept aside: the space is the filesystem's again, and a
                    # holder of the file keeps its bytes (docs/design.md invariant 24).
                    os.unlink(parts[-1], dir_fd=dirs.fd)  # a link itself, never its target
                except FileNotFoundError:
                    return
                dirs.prune_empty()
            finally:
                dirs.close()

    def delete_if(self, key: str, version: str) -> bool:
        """Compare and unlink under one directory descriptor (no path walked twice)."""
        parts = check_key(key, tier=self.label)
        with translate_os_errors(key, self.label):
            try:
                dirs = self._open_dirs(key, parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return True
            try:
                try:
                    st = os.stat(parts[-1], dir_fd=dirs.fd, follow_symlinks=False)
                except FileNotFoundError:
                    return True
                if not stat_mod.S_ISREG(st.st_mode) or _version(st) != version:
                    return False
                os.unlink(parts[-1], dir_fd=dirs.fd)
                dirs.prune_empty()
                return True
            finally:
                dirs.close()

    def free_bytes(self) -> int | None:
        directory = self.root
        while not os.path.isdir(directory):
            directory = os.path.dirname(directory)
        st = os.statvfs(directory)
        if st.f_flag & os.ST_RDONLY:
            # Unwritable, not full: no free-space check may call it NoSpaceLeft (issue 38, a
            # small read-only mount); the write itself fails, "Read-only file system".
            return None
        return st.f_bavail * st.f_frsize

    def local_path(self, key: str) -> str:
        return self._path(key)
