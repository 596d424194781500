"""A forwarding :class:`~tierstore.storage.backend.Backend` that counts what passes through it.

The simulator puts one in front of each tier's real backend, so every request tierstore
makes (writer, reader, migrator, prune, gc) is counted where it leaves the library. A call
is counted as the requests an object store would serve it with: a listing as one request per
1,000 keys (one at least), ``delete_many`` as one per 1,000 keys when the backend batches
(a local directory counts as batching; an object store whose plugin keeps the default loop
does not: one per key), every other call as one (an S3 read is counted as one GET, though
the plugin may also send a HEAD). Bytes read and written are counted as they
stream, and bytes read are also split by what the key is (manifest, metadata, data, mark).

Attribution: the simulator replays ranks one after another in one process, so the counter
holds one current (phase, actor); work a rank starts on a background thread (the migrator,
write threads) runs while that rank is current, and is charged to it.
"""

from __future__ import annotations

import builtins
import io
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

from tierstore.format import layout
from tierstore.storage.backend import Backend, ObjectInfo, ObjectWriter

__all__ = ["COORDINATOR", "Tally", "RequestCounter", "CountingBackend", "counting_backend"]

#: The actor of coordinator-only work (global plans, commits); ranks are 0..W-1.
COORDINATOR = -1
PAGE = 1000  # keys per list page and per batch delete (S3 ListObjectsV2, DeleteObjects)

REQUEST_KINDS = ("list", "stat", "get", "range_get", "put", "publish", "delete", "batch_delete")


@dataclass
class Tally:
    """What one actor sent during one phase."""

    requests: Counter[str] = field(default_factory=Counter)  # "<tier>.<kind>"
    bytes_read: Counter[str] = field(default_factory=Counter)  # "<tier>.<key kind>"
    bytes_written: int = 0
    seconds: float = 0.0

    def count(self, tier: str | None = None, kinds: Iterable[str] | None = None) -> int:
        """Requests to ``tier`` (every tier: ``None``) of ``kinds`` (all: ``None``)."""
        return sum(n for key, n in self.requests.items() if _matches(key, tier, kinds))

    def read(self, tier: str | None = None, kinds: Iterable[str] | None = None) -> int:
        """Bytes read from ``tier`` out of keys of ``kinds`` (see :func:`key_kind`)."""
        return sum(n for key, n in self.bytes_read.items() if _matches(key, tier, kinds))

    def add(self, other: Tally) -> None:
        self.requests.update(other.requests)
        self.bytes_read.update(other.bytes_read)
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds


class RequestCounter:
    """Tallies per (phase, actor); ``phase`` ``None`` stops counting (simulator bookkeeping)."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[str, int], Tally] = {}
        self.phase: str | None = None
        self.actor = COORDINATOR
        #: During the coordinator's commit job: keys that are its own rank's upload work.
        self.own_upload: Callable[[str], bool] | None = None
        self._lock = threading.Lock()

    @contextmanager
    def step(self, phase: str | None, actor: int) -> Iterator[None]:
        """Charge what runs inside to ``actor`` in ``phase``, with its wall time."""
        self.phase, self.actor = phase, actor
        start = time.perf_counter()
        try:
            yield
        finally:
            if phase is not None:
                with self._lock:
                    self.tallies.setdefault((phase, actor), Tally()).seconds += time.perf_counter() - start
            self.phase = None

    def _tally(self, key: str, *, own: bool = True) -> Tally | None:
        if self.phase is None:
            return None
        actor = self.actor
        if own and actor == COORDINATOR and self.own_upload is not None and self.own_upload(key):
            actor = 0
        return self.tallies.setdefault((self.phase, actor), Tally())

    def request(self, tier: str, kind: str, key: str, n: int = 1) -> None:
        with self._lock:
            # Deleting the marks is the commit's work, whoever's mark it is.
            tally = self._tally(key, own="delete" not in kind)
            if tally is not None:
                tally.requests[f"{tier}.{kind}"] += n

    def read(self, tier: str, key: str, n: int) -> None:
        with self._lock:
            tally = self._tally(key)
            if tally is not None:
                tally.bytes_read[f"{tier}.{key_kind(key)}"] += n

    def written(self, key: str, n: int) -> None:
        with self._lock:
            tally = self._tally(key)
            if tally is not None:
                tally.bytes_written += n

    def of(self, phase: str) -> dict[int, Tally]:
        """Every actor's tally in ``phase``."""
        return {actor: t for (p, actor), t in self.tallies.items() if p == phase}


def _matches(key: str, tier: str | None, kinds: Iterable[str] | None) -> bool:
    where, _, what = key.partition(".")
    return (tier is None or where == tier) and (kinds is None or what in kinds)


def key_kind(key: str) -> str:
    """``manifest`` (roots and parts), ``metadata``, ``data``, ``mark`` or ``other``."""
    if key.rsplit("/", 1)[-1] == layout.METADATA_FILE:
        return "metadata"
    kind = layout.kind_of(key).value
    if kind == "data" and "manifest" in key.rsplit("/", 1)[-1]:
        return "manifest"  # a manifest part stored under its attempt (two-level manifest)
    if kind in ("upload-mark", "migrated-mark", "lease", "store-id"):
        return "mark"
    return kind if kind in ("manifest", "data") else "other"


class _CountedReader(io.RawIOBase):
    def __init__(self, stream: BinaryIO, key: str, counter: RequestCounter, tier: str) -> None:
        super().__init__()
        self._stream, self._key, self._counter, self._tier = stream, key, counter, tier

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._stream.read(len(view))
        view[: len(data)] = data
        self._counter.read(self._tier, self._key, len(data))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


class _CountedWriter(ObjectWriter):
    def __init__(self, inner: ObjectWriter, counter: RequestCounter) -> None:
        super().__init__(inner.key)
        self._inner, self._counter = inner, counter

    def _write(self, view: memoryview) -> None:
        self._inner.write(view)
        self._counter.written(self.key, len(view))

    def _commit(self) -> None:
        self._inner.close()
        # The backend contract: a closed writer names the object it stored. Without it
        # every upload mark named no versions, and the cold commit verified every file
        # again (W = 4,096: 24,597 requests and 32 MiB read instead of 32 requests).
        self.version = self._inner.version

    def _abort(self) -> None:
        self._inner.abort()


class CountingBackend(Backend):
    """Forwards every call to ``inner`` and counts it (module docstring)."""

    scheme = "count"

    def __init__(self, inner: Backend, counter: RequestCounter, role: str) -> None:
        super().__init__(inner.url)
        self.inner, self.counter, self.role = inner, counter, role
        self.label = inner.label
        # A filesystem has no request to batch: its delete_many is one call of the contract.
        # An object store batches only where its plugin overrides the default loop.
        self._batches = type(inner).delete_many is not Backend.delete_many or inner.scheme in (
            "file",
            "memory",
        )

    def open_write(self, key: str, *, defer_dir_sync: bool = False) -> ObjectWriter:
        self.counter.request(self.role, "put", key)
        return _CountedWriter(self.inner.open_write(key, defer_dir_sync=defer_dir_sync), self.counter)

    def sync_dirs(self, keys: Iterable[str]) -> None:
        self.inner.sync_dirs(keys)  # a local fsync, no request

    def open_read(self, key: str) -> BinaryIO:
        self.counter.request(self.role, "get", key)
        return self._counted(self.inner.open_read(key), key)

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        self.counter.request(self.role, "range_get", key)
        return self._counted(self.inner.open_range(key, offset, length), key)

    def _counted(self, stream: BinaryIO, key: str) -> BinaryIO:
        return cast(BinaryIO, io.BufferedReader(_CountedReader(stream, key, self.counter, self.role)))

    def publish(self, key: str, data: bytes) -> None:
        self.counter.request(self.role, "publish", key)
        self.inner.publish(key, data)
        self.counter.written(key, len(data))

    def stat(self, key: str) -> ObjectInfo:
        self.counter.request(self.role, "stat", key)
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.counter.request(self.role, "list", prefix)
        for n, info in enumerate(self.inner.list(prefix)):
            if n and n % PAGE == 0:
                self.counter.request(self.role, "list", prefix)
            yield info

    def delete(self, key: str) -> None:
        self.counter.request(self.role, "delete", key)
        self.inner.delete(key)

    def delete_if(self, key: str, version: str) -> bool:
        self.counter.request(self.role, "delete", key)  # If-Match / ifGenerationMatch: one
        return self.inner.delete_if(key, version)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        if self._batches:
            self.counter.request(self.role, "batch_delete", keys[0], -(-len(keys) // PAGE))
        else:
            self.counter.request(self.role, "delete", keys[0], len(keys))
        self.inner.delete_many(keys)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def abort_stale_uploads(
        self, *, older_than: float, dry_run: bool = True, now: float | None = None
    ) -> builtins.list[str]:
        self.counter.request(self.role, "list", "")  # one ListMultipartUploads
        return self.inner.abort_stale_uploads(older_than=older_than, dry_run=dry_run, now=now)

    def close(self) -> None:
        self.inner.close()


class SpreadCountingBackend(CountingBackend):
    """For object stores: keeps the inner backend's hashed data-key layout (``spread_keys``)."""

    spread_keys = True


def counting_backend(inner: Backend, counter: RequestCounter, role: str) -> CountingBackend:
    """``inner`` (the tier ``role``) behind a counter, keeping its key layout."""
    cls = SpreadCountingBackend if inner.spread_keys else CountingBackend
    return cls(inner, counter, role)
