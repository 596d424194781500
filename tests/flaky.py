"""A local backend that fails on purpose, for migration fault tests (registered as flaky://).

Failures are scripted per root in ``FAILURES[root][op] = n``: the next ``n`` calls of ``op``
fail, transiently (503 SlowDown) unless the backend was opened with ``permanent=True``.
``CALLS[root][op]`` counts every call, so tests can prove work was skipped.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from tierstore.errors import StorageError, TransientStorageError
from tierstore.storage.backend import ObjectWriter
from tierstore.storage.local import LocalBackend

FAILURES: dict[str, Counter[str]] = defaultdict(Counter)
CALLS: dict[str, Counter[str]] = defaultdict(Counter)


class FlakyBackend(LocalBackend):
    scheme = "flaky"

    def __init__(self, url: str, *, permanent: bool = False, **options: Any) -> None:
        super().__init__(url.replace("flaky://", "file://", 1), **options)
        self.permanent = permanent

    def _call(self, op: str, key: str) -> None:
        CALLS[self.root][op] += 1
        if FAILURES[self.root][op] > 0:
            FAILURES[self.root][op] -= 1
            error = StorageError if self.permanent else TransientStorageError
            raise error(
                "503 SlowDown (injected)" if not self.permanent else "403 AccessDenied (injected)",
                key=key,
                tier=self.label,
            )

    def open_write(self, key: str) -> ObjectWriter:
        self._call("open_write", key)
        return super().open_write(key)

    def publish(self, key: str, data: bytes) -> None:
        self._call("publish", key)
        super().publish(key, data)
