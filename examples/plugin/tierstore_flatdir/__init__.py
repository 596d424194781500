"""``flatdir:///path``: every object is one file directly in ``/path``, its key escaped.

A complete, deliberately small tierstore backend plugin. It implements the contract of
:mod:`tierstore.storage.backend` (write with CRC32C, exclusive atomic publish, read, stat, list,
delete) and proves it with :class:`tierstore.testing.BackendContract`.
"""

from __future__ import annotations

import os
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from tierstore.errors import ConfigError, PublishConflict
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key, translate_os_errors

__all__ = ["FlatDirBackend"]


class _Writer(ObjectWriter):
    # The base class counts size and CRC32C of every write(); we only move bytes. The
    # contract: no partial object is ever visible under the key, so write a temporary and
    # move it into place (replacing any older object) on commit.
    def __init__(self, key: str, path: str, backend: FlatDirBackend, defer_dir_sync: bool) -> None:
        super().__init__(key)
        self._path, self._backend, self._defer_dir_sync = path, backend, defer_dir_sync
        self._tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # '%' escapes mean no key ends like this
        self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed by _commit/_abort

    def _write(self, view: memoryview) -> None:
        with translate_os_errors(self.key, self._backend.label):
            self._file.write(view)

    def _commit(self) -> None:
        with translate_os_errors(self.key, self._backend.label):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
            if not self._defer_dir_sync:  # else the caller's sync_dirs makes the entry durable
                self._backend._sync_dir()

    def _abort(self) -> None:
        self._file.close()
        os.unlink(self._tmp)


class FlatDirBackend(Backend):
    scheme = "flatdir"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != self.scheme or options:
            raise ConfigError(f"want flatdir:///absolute/path and no options, got {url!r}")
        self.root = parsed.path

    def _file(self, key: str) -> str:
        check_key(key, tier=self.label)
        return os.path.join(self.root, urllib.parse.quote(key, safe=""))

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        path = self._file(key)
        with translate_os_errors(key, self.label):
            os.makedirs(self.root, exist_ok=True)
            return _Writer(key, path, self, defer_dir_sync)

    def sync_dirs(self, keys: Iterable[str]) -> None:
        # Every object lives in the one root directory: one fsync covers them all.
        if list(keys) and os.path.isdir(self.root):
            self._sync_dir()

    def open_read(self, key: str) -> BinaryIO:
        with translate_os_errors(key, self.label, reading=True):
            return open(self._file(key), "rb")

    def publish(self, key: str, data: bytes) -> None:
        path = self._file(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # '%' escapes mean no key can end like this
        with translate_os_errors(key, self.label):
            os.makedirs(self.root, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic and exclusive
            except FileExistsError as err:
                raise PublishConflict("already published", key=key, tier=self.label) from err
            finally:
                os.unlink(tmp)
            self._sync_dir()

    def stat(self, key: str) -> ObjectInfo:
        with translate_os_errors(key, self.label, reading=True):
            st = os.stat(self._file(key))
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not os.path.isdir(self.root):
            return
        for name in sorted(os.listdir(self.root)):
            key = urllib.parse.unquote(name)
            if key.startswith(prefix) and ".tmp-" not in name:
                st = os.stat(os.path.join(self.root, name))
                yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
