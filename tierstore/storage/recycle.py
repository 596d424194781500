"""Files a local tier deleted, kept for the next writes to overwrite in place.

A checkpoint run that keeps its newest few checkpoints deletes one as it writes the next, of
the same size. Unlinked, the old files give their pages (tmpfs, the page cache) and blocks
back, and the next save takes new ones: the kernel allocates and maps every page again, and
on a VM whose balloon reports free memory to its host (virtio_balloon free page reporting)
the host must back each of them again before the copy into it can go on, which made a save's
system time swing 1.5-7x from one save to the next on the machines we measure on
(docs/benchmarks.md). Databases recycle their log segments for the same reason.

So a deleted data file of at least :data:`MIN_SIZE` bytes is renamed into the pool
(``<root>/.recycle/``, outside every key) while the pool holds less than its cap, and the next
:meth:`RecyclePool.take` renames one back as a new object's temporary, to be overwritten from
offset 0 and truncated to what was written before it is committed. Nothing a reader holds is
ever overwritten: a file is taken only once a write lease on it is granted (``F_SETLEASE``),
which Linux refuses while any other descriptor or mapping of the file is open on this machine;
such a file is unlinked instead, and its readers keep their copy. A lease sees only this
machine, so the pool is on only where every reader is on it: a filesystem of this node's own
(:data:`LOCAL_FILESYSTEMS`: tmpfs, ext4, xfs, btrfs, ...), never NFS, Lustre, GPFS or FUSE,
whose other clients a lease cannot see. A file with another hard link is never recycled (the
other name would see the new bytes). Where leases are refused for other reasons (another
owner), the pool turns itself off and deletes as before.

The pool's bytes count as free space (:meth:`LocalBackend.free_bytes`); a write that finds the
disk full empties the pool and tries again; files older than :data:`MAX_AGE` are unlinked
whenever the pool is used, and :meth:`RecyclePool.drain` (``tierstore gc``) empties it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat as stat_mod
import threading
import time
import uuid
from collections.abc import Iterator

log = logging.getLogger(__name__)

__all__ = [
    "DIR",
    "LOCAL_FILESYSTEMS",
    "MAX_AGE",
    "MIN_SIZE",
    "RecyclePool",
    "filesystem_type",
    "fresh_mtime",
    "unlink_quietly",
]

DIR = ".recycle"  # below the root; LocalBackend refuses it as a key
MIN_SIZE = 1 << 20  # smaller files (manifests, marks) are not worth keeping
MAX_AGE = 3600.0  # seconds a file waits in the pool before it is unlinked
_DIR_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_REUSE_FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_HELD = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EBUSY}  # a lease refused: someone has it open
# Filesystems only this machine mounts: a lease on one of their files sees every reader.
LOCAL_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs"})


def filesystem_type(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it), or None."""
    try:
        real = os.path.realpath(path)
        with open(mounts) as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for fields in table:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fields[2])
    return None if best is None else best[1]


class RecyclePool:
    """The pool of one local tier root; ``cap`` bytes at most (0: off; None: a quarter of
    the filesystem's size, found when the first file comes in)."""

    def __init__(self, root: str, cap: int | None = None) -> None:
        self.root = root
        self._cap = cap
        self._lock = threading.Lock()  # one rename per file at a time in this process
        self._leases: bool | None = None if hasattr(fcntl, "F_SETLEASE") else False

    def _local(self) -> bool:
        if self._leases is None:
            directory = self.root
            while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
                directory = os.path.dirname(directory)
            self._leases = filesystem_type(directory) in LOCAL_FILESYSTEMS
        return self._leases

    @property
    def enabled(self) -> bool:
        return self._cap != 0 and self._local()

    @property
    def cap(self) -> int:
        if self._cap is None:
            st = os.statvfs(self.root)
            self._cap = st.f_blocks * st.f_frsize // 4
        return self._cap

    def _open(self, create: bool) -> int | None:
        root = os.open(self.root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))  # the root may be a link
        try:
            try:
                return os.open(DIR, _DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                if not create:
                    return None
            try:
                os.mkdir(DIR, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            return os.open(DIR, _DIR_FLAGS, dir_fd=root)
        finally:
            os.close(root)

    def _entries(self, pool: int) -> list[tuple[str, os.stat_result]]:
        """The pool's files, oldest first; those past :data:`MAX_AGE` are unlinked."""
        found = []
        now = time.time()
        with os.scandir(pool) as scan:
            for entry in scan:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat_mod.S_ISREG(st.st_mode) or now - st.st_ctime > MAX_AGE:
                    unlink_quietly(entry.name, pool)
                    continue
                found.append((entry.name, st))
        found.sort(key=lambda e: e[1].st_ctime)
        return found

    @contextlib.contextmanager
    def _existing(self) -> Iterator[int | None]:
        """The pool directory's descriptor, or None where there is no pool (yet)."""
        try:
            pool = self._open(create=False)
        except OSError:
            pool = None
        try:
            yield pool
        finally:
            if pool is not None:
                os.close(pool)

    def held_bytes(self) -> int:
        """Bytes the pool holds (they count as free space)."""
        with self._existing() as pool:
            try:
                return 0 if pool is None else sum(st.st_blocks * 512 for _, st in self._entries(pool))
            except OSError:
                return 0

    def put(self, name: str, directory: int, st: os.stat_result) -> bool:
        """Move file ``name`` of ``directory`` into the pool instead of unlinking it; False
        where it does not go (too small, the pool full or off): the caller unlinks it."""
        if not stat_mod.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size < MIN_SIZE or not self.enabled:
            return False
        try:
            pool = self._open(create=True)
            if pool is None:  # pragma: no cover - created above
                return False
            try:
                with self._lock:
                    held = sum(s.st_blocks * 512 for _, s in self._entries(pool))
                    if held + st.st_blocks * 512 > self.cap:
                        return False
                    os.rename(name, uuid.uuid4().hex, src_dir_fd=directory, dst_dir_fd=pool)
                return True
            finally:
                os.close(pool)
        except OSError as err:  # another filesystem below the root, a full directory...
            log.debug("not recycling %s: %s", name, err)
            return False

    def take(self, directory: int, name: str) -> tuple[int, int] | None:
        """Rename a pooled file to ``name`` in ``directory`` and open it for writing from
        offset 0 (the caller truncates it to what it wrote, then :func:`fresh_mtime`); return
        the descriptor and the file's mtime (ns) as it was deleted, or None where the pool has
        none that nobody holds open."""
        if not self.enabled:
            return None
        with self._existing() as pool:
            return None if pool is None else self._take_from(pool, directory, name)

    def _take_from(self, pool: int, directory: int, name: str) -> tuple[int, int] | None:
        # On the save path, once per file written: names only, and one stat for the file
        # about to be taken (a plain file not past its age), not one for every pooled file.
        try:
            with os.scandir(pool) as scan:
                names = [entry.name for entry in scan]
            for entry in names:
                try:
                    st = os.stat(entry, dir_fd=pool, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # another process took it
                if not stat_mod.S_ISREG(st.st_mode) or time.time() - st.st_ctime > MAX_AGE:
                    unlink_quietly(entry, pool)
                    continue
                with self._lock:
                    try:
                        os.rename(entry, name, src_dir_fd=pool, dst_dir_fd=directory)
                    except FileNotFoundError:
                        continue  # another process took it
                claimed = self._claim(directory, name)
                if claimed is not None:
                    return claimed
                if not self.enabled:
                    return None
            return None
        except OSError as err:
            log.debug("not reusing a recycled file: %s", err)
            return None

    def _claim(self, directory: int, name: str) -> tuple[int, int] | None:
        """Open the taken file; keep it only if it is a plain file of ours with no other name
        and a write lease proves nobody else has it open."""
        try:
            fd = os.open(name, _REUSE_FLAGS, dir_fd=directory)  # a link swapped in: ELOOP
        except OSError:
            unlink_quietly(name, directory)
            return None
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            os.close(fd)  # planted, or linked since: unlinking our name leaves the other be
            unlink_quietly(name, directory)
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            return fd, st.st_mtime_ns
        except OSError as err:
            os.close(fd)
            unlink_quietly(name, directory)  # whoever holds it keeps the copy they have
            if err.errno not in _HELD:
                log.info("%s: no file leases here (%s); deleted files are no longer recycled", self.root, err)
                self._leases = False
            return None

    def drain(self) -> int:
        """Unlink every pooled file; return the bytes given back."""
        freed = 0
        with self._existing() as pool:
            if pool is None:
                return 0
            with os.scandir(pool) as scan:
                entries = list(scan)
            for entry in entries:
                try:
                    blocks = entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
                if unlink_quietly(entry.name, pool):
                    freed += blocks
        return freed


def fresh_mtime(fd: int, old_mtime_ns: int) -> None:
    """Make sure a recycled file's new contents do not carry the version it had
    (``LocalBackend`` versions are inode, size and mtime): on a filesystem whose clock ticks
    coarsely, a rewrite of the same size within one tick would keep all three."""
    st = os.fstat(fd)
    if st.st_mtime_ns == old_mtime_ns:
        os.utime(fd, ns=(st.st_atime_ns, old_mtime_ns + 1))


def unlink_quietly(name: str, directory: int) -> bool:
    """Unlink ``name`` of ``directory``; False where it could not be (gone already...)."""
    try:
        os.unlink(name, dir_fd=directory)
    except OSError:
        return False
    return True
