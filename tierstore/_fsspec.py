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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec

from tierstore.backend import Backend, ObjectInfo, ObjectWriter, check_key, translate_os_errors
from tierstore.errors import ConfigError, ObjectNotFound, PublishConflict, StorageError

__all__ = ["FsspecBackend"]

PREFIX = "fsspec+"


class _FsspecWriter(ObjectWriter):
    def __init__(self, key: str, stream: Any, backend: FsspecBackend) -> None:
        super().__init__(key)
        self._stream = stream
        self._backend = backend

    def _write(self, view: memoryview) -> None:
        with translate_os_errors(self.key, self._backend.label):
            self._stream.write(view)

    def _commit(self) -> None:
        with translate_os_errors(self.key, self._backend.label):
            self._stream.flush()
            fileno = getattr(self._stream, "fileno", None)
            if callable(fileno):  # a local file underneath: make it durable
                try:
                    os.fsync(fileno())
                except (OSError, ValueError, NotImplementedError):
                    pass
            self._stream.close()

    def _abort(self) -> None:
        try:
            discard = getattr(self._stream, "discard", None)  # buffered object-store writers
            if callable(discard):
                discard()
            else:
                self._stream.close()
        finally:
            self._backend.delete(self.key)


class FsspecBackend(Backend):
    """A tier on any fsspec filesystem (see the module docstring for its guarantees)."""

    scheme = "fsspec"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        if not url.startswith(PREFIX):
            raise ConfigError(f"an fsspec tier URL starts with {PREFIX!r}: {url!r}")
        inner = url[len(PREFIX) :]
        self.fs, root = fsspec.core.url_to_fs(inner, skip_instance_cache=True, **options)
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return "/".join([self.root, *check_key(key, tier=self.label)])

    def _rel(self, path: str) -> str:
        path = self.fs._strip_protocol(path)
        root = self.fs._strip_protocol(self.root)
        return path[len(root) :].lstrip("/")

    def open_write(self, key: str) -> ObjectWriter:
        path = self._path(key)
        with translate_os_errors(key, self.label):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            stream = self.fs.open(path, "wb")
        return _FsspecWriter(key, stream, self)

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        with translate_os_errors(key, self.label, reading=True):
            if self.fs.isdir(path):
                raise FileNotFoundError(path)
            return self.fs.open(path, "rb")  # type: ignore[no-any-return]

    def publish(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with translate_os_errors(key, self.label):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            try:
                with self.fs.open(path, "xb") as stream:
                    stream.write(data)
            except FileExistsError as err:
                raise PublishConflict("already published", key=key, tier=self.label) from err
            except (ValueError, NotImplementedError) as err:
                raise StorageError(
                    f"{type(self.fs).__name__} has no exclusive create ('xb'): tierstore "
                    "cannot commit checkpoints on it safely", key=key, tier=self.label,
                ) from err

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        with translate_os_errors(key, self.label, reading=True):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise ObjectNotFound("no such object", key=key, tier=self.label)
        return ObjectInfo(key=key, size=int(info["size"]), mtime=_mtime(info))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        top = self._path(prefix.rstrip("/")) if prefix else self.root
        if not self.fs.exists(top):
            return
        for path, info in sorted(self.fs.find(top, detail=True).items()):
            if info.get("type") == "file":
                yield ObjectInfo(key=self._rel(path), size=int(info["size"]), mtime=_mtime(info))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with translate_os_errors(key, self.label):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass


def _mtime(info: dict[str, Any]) -> float | None:
    for field in ("mtime", "created", "LastModified", "updated"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        stamp = getattr(value, "timestamp", None)
        if callable(stamp):
            return float(stamp())
    return None
