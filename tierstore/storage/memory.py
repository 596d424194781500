"""``memory://name``: an in-process store, for tests and examples.

Stores live for the life of the process, shared by every backend opened on the same
``memory://name`` (a writer and a later reader see the same data), like fsspec's memory
filesystem. Nothing survives the process, so it is no tier for real checkpoints.
"""

from __future__ import annotations

import io
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from tierstore.errors import ConfigError, ObjectNotFound, PublishConflict
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter, check_key

__all__ = ["MemoryBackend"]

# Process-wide by design (see module docstring): name -> key -> (data, mtime, version).
_STORES: dict[str, dict[str, tuple[bytes, float, str]]] = {}
_LOCK = threading.Lock()
_WRITES = itertools.count(1)  # versions: every write of any key gets the next number


def _entry(data: bytes) -> tuple[bytes, float, str]:
    return data, time.time(), str(next(_WRITES))


class _MemoryWriter(ObjectWriter):
    def __init__(self, key: str, backend: MemoryBackend) -> None:
        super().__init__(key)
        self._backend = backend
        self._chunks: list[bytes] = []

    def _write(self, view: memoryview) -> None:
        self._chunks.append(bytes(view))

    def _commit(self) -> None:
        data = b"".join(self._chunks)
        self._chunks.clear()
        entry = _entry(data)
        with _LOCK:
            self._backend._store[self.key] = entry
        self.version = entry[2]

    def _abort(self) -> None:
        self._chunks.clear()


class MemoryBackend(Backend):
    """Objects in a process-global dict; publish is exclusive under one lock."""

    scheme = "memory"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        if options:
            raise ConfigError(f"unknown options for memory://: {sorted(options)}")
        if not url.startswith("memory://"):
            raise ConfigError(f"not a memory:// URL: {url!r}")
        name = url[len("memory://") :].strip("/")
        with _LOCK:
            self._store = _STORES.setdefault(name, {})

    def _key(self, key: str) -> str:
        check_key(key, tier=self.label)
        return key

    def _get(self, key: str) -> bytes:
        try:
            return self._store[self._key(key)][0]
        except KeyError:
            raise ObjectNotFound("no such object", key=key, tier=self.label) from None

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        return _MemoryWriter(self._key(key), self)

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self._get(key))

    def publish(self, key: str, data: bytes) -> None:
        key = self._key(key)
        with _LOCK:
            if key in self._store:
                raise PublishConflict("already published", key=key, tier=self.label)
            self._store[key] = _entry(bytes(data))

    def stat(self, key: str) -> ObjectInfo:
        try:
            data, mtime, version = self._store[self._key(key)]
        except KeyError:
            raise ObjectNotFound("no such object", key=key, tier=self.label) from None
        return ObjectInfo(key=key, size=len(data), mtime=mtime, version=version)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list prefix must be '' or end with '/': {prefix!r}")
        with _LOCK:
            items = [(k, v) for k, v in self._store.items() if k.startswith(prefix)]
        for key, (data, mtime, version) in sorted(items):
            yield ObjectInfo(key=key, size=len(data), mtime=mtime, version=version)

    def delete(self, key: str) -> None:
        with _LOCK:
            self._store.pop(self._key(key), None)

    def delete_if(self, key: str, version: str) -> bool:
        key = self._key(key)
        with _LOCK:
            found = self._store.get(key)
            if found is not None and found[2] != version:
                return False
            self._store.pop(key, None)
            return True
