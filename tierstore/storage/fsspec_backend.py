"""``fsspec+<protocol>://...``: any fsspec filesystem as a tier.

``fsspec+sftp://host/path``, ``fsspec+abfs://container/path``, ``fsspec+file:///data``: the
part after ``fsspec+`` is handed to fsspec, options become its storage options.

Guarantees depend on the filesystem, so read them before trusting one with checkpoints:
publish uses fsspec's exclusive create (``open(path, "xb")``), which every filesystem that
supports it makes exclusive; it is also atomic on object stores that implement it with a
conditional PUT, but on a local or network filesystem a reader may briefly see a partly
written manifest (it then fails validation and counts as not committed). Filesystems without
exclusive create are refused at publish. For local disks and parallel filesystems prefer
the built-in local backend (plain paths), which fsyncs and publishes atomically.

Writes go to a temporary beside the key (``.<name>.tmp-<hex>``, debris gc recognises) that
``close()`` moves over the key with ``fs.mv``, so an aborted write never touches an existing
object. Whether that move is atomic is the filesystem's: a rename on local and most network
filesystems, a copy then a delete on object stores (whose copy is atomic, but costs a
server-side copy: use the dedicated S3/GCS backends there). Best effort, then.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, cast

import fsspec

from tierstore._redact import redact_url, scrub, url_secrets
from tierstore.errors import ConfigError, ObjectNotFound, PublishConflict, StorageError, TierstoreError
from tierstore.storage.backend import (
    Backend,
    ObjectInfo,
    ObjectWriter,
    _Limited,
    check_key,
    translate_os_errors,
)

__all__ = ["FsspecBackend"]

PREFIX = "fsspec+"


class _FsspecWriter(ObjectWriter):
    def __init__(self, key: str, stream: Any, tmp: str, path: str, backend: FsspecBackend) -> None:
        super().__init__(key)
        self._stream = stream
        self._tmp = tmp
        self._path = path
        self._backend = backend

    def _write(self, view: memoryview) -> None:
        with self._backend.errors(self.key):
            self._stream.write(view)

    def _commit(self) -> None:
        with self._backend.errors(self.key):
            self._stream.flush()
            fileno = getattr(self._stream, "fileno", None)
            if callable(fileno):  # a local file underneath: make it durable
                try:
                    os.fsync(fileno())
                except (OSError, ValueError, NotImplementedError):
                    pass
            self._stream.close()
            try:
                self._backend.fs.mv(self._tmp, self._path)  # see the module docstring
            except BaseException:
                self._remove_temporary()
                raise

    def _abort(self) -> None:
        try:
            discard = getattr(self._stream, "discard", None)  # buffered object-store writers
            # A local file (autocommit) refuses discard() with a RuntimeError, which replaced
            # the error that made us abort; its temporary is removed below instead.
            if callable(discard) and not getattr(self._stream, "autocommit", False):
                discard()
            else:
                self._stream.close()
        finally:
            self._remove_temporary()  # never the key: it may hold another writer's object

    def _remove_temporary(self) -> None:
        try:
            self._backend.fs.rm_file(self._tmp)
        except Exception:  # a buffered writer may never have created it
            pass


class FsspecBackend(Backend):
    """A tier on any fsspec filesystem (see the module docstring for its guarantees)."""

    scheme = "fsspec"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        if not url.startswith(PREFIX):
            raise ConfigError(f"an fsspec tier URL starts with {PREFIX!r}: {redact_url(url)!r}")
        inner = url[len(PREFIX) :]
        # Some filesystems (memory, file) keep userinfo in the path, so it can surface in
        # the filesystem's own error text: errors() scrubs these from what we raise.
        self._secrets = url_secrets(url)
        self.fs, root = fsspec.core.url_to_fs(inner, skip_instance_cache=True, **options)
        self.root = root.rstrip("/")

    @contextmanager
    def errors(self, key: str, *, reading: bool = False) -> Iterator[None]:
        """``translate_os_errors``, with the URL's credentials scrubbed from the message."""
        try:
            with translate_os_errors(key, self.label, reading=reading):
                yield
        except TierstoreError as err:
            if not any(s in str(err) for s in self._secrets):
                raise
            context = {
                k: scrub(v, self._secrets) if isinstance(v, str) else v for k, v in err.context.items()
            }
            # from None: the original exception's text holds the secret too.
            raise type(err)(scrub(err.message, self._secrets), **context) from None

    def _path(self, key: str) -> str:
        return "/".join([self.root, *check_key(key, tier=self.label)])

    def _rel(self, path: str) -> str:
        path = self.fs._strip_protocol(path)
        root = self.fs._strip_protocol(self.root)
        return path[len(root) :].lstrip("/")

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        path = self._path(key)
        with self.errors(key):
            directory, base = path.rsplit("/", 1)
            tmp = f"{directory}/.{base}.tmp-{uuid.uuid4().hex[:12]}"
            self.fs.makedirs(directory, exist_ok=True)
            stream = self.fs.open(tmp, "wb")
        return _FsspecWriter(key, stream, tmp, path, self)

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        with self.errors(key, reading=True):
            if self.fs.isdir(path):
                raise FileNotFoundError(path)
            return self.fs.open(path, "rb")  # type: ignore[no-any-return]

    def publish(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self.errors(key):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            try:
                with self.fs.open(path, "xb") as stream:
                    stream.write(data)
            except FileExistsError as err:
                raise PublishConflict("already published", key=key, tier=self.label) from err
            except (ValueError, NotImplementedError) as err:
                raise StorageError(
                    f"{type(self.fs).__name__} has no exclusive create ('xb'): tierstore "
                    "cannot commit checkpoints on it safely",
                    key=key,
                    tier=self.label,
                ) from err

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        with self.errors(key, reading=True):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise ObjectNotFound("no such object", key=key, tier=self.label)
        return ObjectInfo(key=key, size=int(info["size"]), mtime=_mtime(info), version=_version(info))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        top = self._path(prefix.rstrip("/")) if prefix else self.root
        if not self.fs.exists(top):
            return
        for path, info in sorted(self.fs.find(top, detail=True).items()):
            if info.get("type") == "file":
                yield ObjectInfo(
                    key=self._rel(path), size=int(info["size"]), mtime=_mtime(info), version=_version(info)
                )

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self.errors(key):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def delete_many(self, keys: Iterable[str]) -> None:
        # fsspec's rm of a list is the filesystem's batch delete (s3fs: DeleteObjects, 1,000
        # keys a request); some filesystems refuse a missing key, and then one at a time does.
        keys = list(keys)
        if not keys:
            return
        with self.errors(keys[0]):
            try:
                self.fs.rm([self._path(key) for key in keys])
                return
            except FileNotFoundError:
                pass
        for key in keys:
            self.delete(key)

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        path = self._path(key)
        with self.errors(key, reading=True):
            # No read-ahead cache: each read asks for exactly the bytes the reader wants.
            stream = self.fs.open(path, "rb", cache_type="none")
            stream.seek(offset)
        return cast(BinaryIO, _Limited(stream, length))


def _mtime(info: dict[str, Any]) -> float | None:
    for field in ("mtime", "created", "LastModified", "updated"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        stamp = getattr(value, "timestamp", None)
        if callable(stamp):
            return float(stamp())
    return None


def _version(info: dict[str, Any]) -> str | None:
    """What the filesystem reports that changes with each write (an object store's ETag or
    generation); ``None`` otherwise: tierstore then verifies the bytes instead."""
    for field in ("generation", "ETag", "etag"):
        value = info.get(field)
        if value:
            return str(value).strip('"')
    return None
