"""The storage contract every tier implements.

A :class:`Backend` stores immutable objects under ``/``-separated keys relative to its
root URL. tierstore needs only these guarantees, stated once here:

* **Keys** are relative: no leading ``/``, no ``.``/``..`` or empty components, no
  backslashes or NULs (:func:`check_key`). A backend never touches anything outside its root.
* **Writes** (:meth:`Backend.open_write`) stream a new object. The returned
  :class:`ObjectWriter` computes size and CRC32C of every byte as it goes; when its
  ``close()`` returns, the object is durable and complete under its key (local: file fsync,
  rename into place, directory fsync; object store: upload completed and verified). A
  write never exposes a partial object under its key; if the key exists, ``close()``
  replaces it atomically. ``abort()``, or an exception inside ``with``, discards what was
  written and leaves an existing object untouched. tierstore only writes keys unique to one
  attempt, and a migrator replacing an object replaces it with the same verified bytes.
  ``write()`` takes any buffer (bytes, memoryview of tensor or numpy memory) and never copies
  it into a new bytes object.
* **Acknowledged bytes and resumed writes**: :meth:`ObjectWriter.report_stored` has a
  callback told of the bytes the store acknowledged holding as the write goes (each part of an
  S3 multipart upload, each chunk of a GCS resumable one; every other backend: the whole
  object when ``close()`` returns). :meth:`ObjectWriter.suspend` stops a write like
  ``abort()`` but leaves what the store acknowledged (S3's pending upload, GCS's session), as
  a killed process does; a later write of the same key may reuse it, only where it proves
  that the store holds the very bytes written now (S3: each part's size and CRC32C or MD5;
  GCS: the CRC32C of the bytes its session confirmed), and verifies the object whole as every
  write does. A backend that cannot reuse anything discards on ``suspend()``.
* **Deferred directory durability**: ``open_write(key, defer_dir_sync=True)`` lets a backend
  whose publication needs a directory fsync (local) leave that fsync to
  :meth:`Backend.sync_dirs`, which makes the entries of all the given keys durable at once
  (one fsync per distinct directory, not per file). Until then a closed object is complete
  and readable but may vanish at a power loss. Backends that publish durably anyway (object
  stores) ignore the flag, and ``sync_dirs`` does nothing; it never fails for keys that were
  never written. A plugin whose ``open_write`` predates the keyword is accepted as is.
* **Publish** (:meth:`Backend.publish`) is the only atomic primitive: the whole object
  appears at once or not at all, it is durable when the call returns, and it is
  *exclusive*: if the key exists, it raises :class:`~tierstore.errors.PublishConflict`
  and changes nothing; of two racing publishers exactly one wins. There is no rename.
* **Reads** see every completed write and publish (read-after-write).
* **Ranged reads** (:meth:`Backend.open_range`) stream ``length`` bytes from ``offset`` and
  cost one request on an object store (a ranged GET), never a download of what precedes.
* **Delete** is idempotent: deleting a missing key succeeds. :meth:`Backend.delete_many`
  removes many keys in as few requests as the backend allows (S3 ``DeleteObjects``: 1,000
  keys per request); it is not atomic: on an error some keys may be gone, none is damaged,
  and calling it again finishes the job.
* **Versions**: :attr:`ObjectInfo.version` (in ``stat`` and ``list`` alike) and
  :attr:`ObjectWriter.version` (once ``close()`` returned) name the stored object as it was
  last written: S3's ETag, GCS's generation, a local file's inode, size and nanosecond
  mtime. Writing the key again with other bytes gives another version (the same bytes may
  or may not). ``None`` where a backend cannot tell; callers then verify the bytes instead.
  :meth:`Backend.delete_if` deletes a key only while it still holds one version (S3
  ``If-Match``, GCS ``ifGenerationMatch``): an object written since is never deleted by a
  decision made about an older one.
* **Errors** are translated into the :mod:`tierstore.errors` tree, naming key and tier;
  retryable failures are :class:`~tierstore.errors.TransientStorageError`.
* **Thread safety**: one backend instance may be used from many threads at once. Backends
  are never pickled; writers and readers rebuild them from URL + options in each process.
"""

from __future__ import annotations

import abc
import builtins
import errno
import functools
import inspect
import io
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, ClassVar, cast

from tierstore._redact import redact_url
from tierstore.errors import (
    NoSpaceLeft,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    StorageError,
    TierstoreError,
    UnsafePath,
)
from tierstore.storage.checksum import crc32c_combine, crc32c_update

__all__ = ["Backend", "ObjectInfo", "ObjectWriter", "check_key", "crc32c_update"]


@dataclass(frozen=True)
class ObjectInfo:
    """What a backend knows about one stored object."""

    key: str
    size: int
    mtime: float | None = None
    crc32c: int | None = None  # set where the backend stores one (S3, GCS)
    version: str | None = None  # names this write of the object (module docstring)


def check_key(key: str, *, tier: str | None = None) -> list[str]:
    """Validate a relative key and return its components; raise :class:`UnsafePath` if not."""
    if not isinstance(key, str) or not key:
        raise UnsafePath("empty or non-string key", key=key, tier=tier)
    parts = key.split("/")
    bad = key.startswith("/") or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts)
    if bad:
        raise UnsafePath("key must be relative and stay inside its root", key=key, tier=tier)
    return parts


class ObjectWriter(abc.ABC):
    """Streams one new object: ``write()`` any buffers, then ``close()`` commits it.

    Tracks ``size`` and ``crc32c`` of everything written, so callers never read a file
    back to checksum it. Used as a context manager, an exception aborts the object.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0
        self.crc32c = 0
        self.closed = False
        self.version: str | None = None  # the stored object's version, set by close()
        self.stored = 0  # bytes the store acknowledged holding (report_stored); size after close()
        self._report: Callable[[int], None] | None = None
        # The storage error a write raised. Callers that write through C++ (torch.save)
        # get a generic RuntimeError back from it; this keeps the real one to re-raise.
        self.failure: TierstoreError | None = None

    def write(self, data: Any, *, crc32c: int | None = None) -> int:
        """Append ``data``; ``crc32c``: its CRC32C, when the caller already computed it (the
        raw encoding checksums each block as it writes it), so the bytes are scanned once."""
        if self.closed:
            raise ValueError(f"write to closed object writer for {self.key!r}")
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self.crc32c = (
            crc32c_update(self.crc32c, view)
            if crc32c is None
            else crc32c_combine(self.crc32c, crc32c, len(view))
        )
        try:
            self._write(view)
        except TierstoreError as err:
            self.failure = err
            raise
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Data is made durable by ``close()``; ``flush()`` exists for ``torch.save``."""

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._commit()
            self._stored(self.size - self.stored)  # what no part acknowledged: all of it, stored

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._abort()

    def suspend(self) -> None:
        """Stop without storing the object, as ``abort()`` does, but leave what the store
        acknowledged for a later write of this key to reuse once verified (module docstring);
        the default discards it."""
        if not self.closed:
            self.closed = True
            self._suspend()

    def report_stored(self, callback: Callable[[int], None] | None) -> None:
        """Call ``callback(n)`` each time the store acknowledges holding ``n`` more bytes of
        this object: as parts are confirmed where the backend reports them
        (:meth:`_stored`), and whatever is left once ``close()`` stored the object. Called
        on the thread that calls ``write()`` and ``close()``; an exception it raises fails
        that call. A part held is not the object: ``close()`` may still fail."""
        self._report = callback

    def _stored(self, n: int) -> None:
        """Backends call this as the store acknowledges ``n`` more bytes (``report_stored``)."""
        if n > 0:
            self.stored += n
            if self._report is not None:
                self._report(n)

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @abc.abstractmethod
    def _write(self, view: memoryview) -> None: ...

    @abc.abstractmethod
    def _commit(self) -> None: ...

    @abc.abstractmethod
    def _abort(self) -> None: ...

    def _suspend(self) -> None:
        """Keep what can be resumed; backends that resume override it."""
        self._abort()


class Backend(abc.ABC):
    """One storage tier: immutable objects under relative keys (contract: module docstring)."""

    scheme: ClassVar[str] = ""
    #: Object stores set this: data keys are then spread over hashed prefixes (see layout).
    spread_keys: ClassVar[bool] = False

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.label = redact_url(url)  # set to e.g. "hot /nvme/run1" by the catalog, used in errors

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("open_write")
        if own is not None and not _takes_defer_dir_sync(own):
            cls.open_write = _ignoring_defer_dir_sync(own)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        # Options may hold credentials: never show them.
        return f"{type(self).__name__}({redact_url(self.url)!r})"

    @abc.abstractmethod
    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        """Start writing a new object at ``key`` (``defer_dir_sync``: module docstring)."""

    def sync_dirs(self, keys: Iterable[str]) -> None:
        """Make durable the directory entries of ``keys`` written with ``defer_dir_sync``."""

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """Open ``key`` for streaming, sequential reading."""

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """Open ``length`` bytes of ``key`` from ``offset`` for streaming; fewer at the end of
        the object. The default seeks a seekable stream, else reads up to ``offset`` and
        drops it: object-store backends override it with one ranged request."""
        stream = self.open_read(key)
        try:
            if _is_seekable(stream):
                stream.seek(offset)
            else:
                left = offset
                while left > 0:
                    skipped = stream.read(min(left, 8 << 20))
                    if not skipped:
                        break
                    left -= len(skipped)
        except BaseException:
            stream.close()
            raise
        return cast(BinaryIO, _Limited(stream, length))

    @abc.abstractmethod
    def publish(self, key: str, data: bytes) -> None:
        """Atomically, durably and exclusively create ``key`` holding ``data``."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size (and what else the backend knows) of ``key``; :class:`ObjectNotFound` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix`` (``""`` or ending in ``/``), recursively."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; succeed if it is already gone."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Remove every key in ``keys``, missing ones included (idempotent, not atomic). The
        default deletes one at a time; backends with a batch request override it."""
        for key in keys:
            self.delete(key)

    def delete_if(self, key: str, version: str) -> bool:
        """Delete ``key`` only while it holds the object ``version`` names: ``True`` if it is
        gone now (deleted, or already absent), ``False`` (nothing deleted) if it holds
        another object. The default compares a ``stat`` and then deletes, which leaves a
        moment between the two; backends with a conditional delete override it."""
        try:
            found = self.stat(key).version
        except ObjectNotFound:
            return True
        if found is None or found != version:
            return False
        self.delete(key)
        return True

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except ObjectNotFound:
            return False
        return True

    def read_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """Read a small object whole; refuse one larger than ``limit`` bytes."""
        with self.open_read(key) as stream:
            data = stream.read(-1 if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"object larger than {limit} bytes", key=key, tier=self.label)
        return bytes(data)

    def free_bytes(self) -> int | None:
        """Free space where the backend can tell (local disks), else ``None``."""
        return None

    def abort_stale_uploads(
        self, *, older_than: float, dry_run: bool = True, now: float | None = None
    ) -> builtins.list[str]:
        """Abort the backend's own debris (S3: incomplete multipart uploads) older than
        ``older_than`` seconds; return what was (or, dry run, would be) aborted."""
        return []

    def close(self) -> None:
        """Release clients and connections."""


def _is_seekable(stream: BinaryIO) -> bool:
    try:
        return bool(stream.seekable())
    except (AttributeError, OSError, ValueError):
        return False


class _Limited(io.RawIOBase):
    """At most ``length`` bytes of ``stream`` from where it stands; closes it when closed."""

    def __init__(self, stream: BinaryIO, length: int) -> None:
        super().__init__()
        self._stream, self._left = stream, max(0, length)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._left)
        if want == 0:
            return 0
        reader = getattr(self._stream, "readinto", None)
        if reader is not None:
            got = reader(view[:want]) or 0
        else:
            data = self._stream.read(want)
            got = len(data)
            view[:got] = data
        self._left -= got
        return got

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def _takes_defer_dir_sync(open_write: Callable[..., ObjectWriter]) -> bool:
    try:
        params = inspect.signature(open_write).parameters.values()
    except (TypeError, ValueError):
        return True  # not introspectable: trust it
    return any(p.name == "defer_dir_sync" or p.kind is p.VAR_KEYWORD for p in params)


def _ignoring_defer_dir_sync(
    open_write: Callable[[Backend, str], ObjectWriter],
) -> Callable[..., ObjectWriter]:
    """Let a plugin written before ``defer_dir_sync`` existed be called with it.

    Ignoring the flag is always safe: such a backend makes each object durable on close,
    sooner than deferring asks for.
    """

    @functools.wraps(open_write)
    def accepting(self: Backend, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        return open_write(self, key)

    return accepting


_ENOSPC = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


@contextmanager
def translate_os_errors(key: str, tier: str, *, reading: bool = False) -> Iterator[None]:
    """Map ``OSError`` raised for ``key`` onto the tierstore error tree.

    ``reading``: a path component that is not a directory means the key is absent.
    """
    try:
        yield
    except TierstoreError:
        raise
    except NotADirectoryError as err:
        if not reading:
            raise StorageError(f"{type(err).__name__}: {err}", key=key, tier=tier) from err
        raise ObjectNotFound("no such object", key=key, tier=tier) from err
    except FileNotFoundError as err:
        raise ObjectNotFound("no such object", key=key, tier=tier) from err
    except FileExistsError as err:
        raise PublishConflict("object already exists", key=key, tier=tier) from err
    except OSError as err:
        if err.errno in _ENOSPC:
            raise NoSpaceLeft(f"no space left: {err.strerror}", key=key, tier=tier) from err
        if err.errno == errno.ELOOP:
            raise UnsafePath("symbolic link in key path", key=key, tier=tier) from err
        raise StorageError(f"{type(err).__name__}: {err}", key=key, tier=tier) from err
