"""CRC32C throughput of the Python CRC32C libraries that are importable here.

``python -m benchmarks.crc_libs`` (with ``PYTHONPATH`` pointing at a scratch ``pip install
--target DIR awscrt fastcrc google-crc32c`` to include the ones tierstore does not depend on).
One 64 MiB buffer, best of 5 per library, GB/s; a library that is not installed says so.
The CRC32C share target of the verified loads (docs/benchmarks.md, under Load) is read against
these numbers.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable

SIZE = 64 << 20


def _libraries() -> dict[str, Callable[[], Callable[[bytes], int]]]:
    def crc32c() -> Callable[[bytes], int]:
        return importlib.import_module("crc32c").crc32c  # type: ignore[no-any-return]

    def google() -> Callable[[bytes], int]:
        return importlib.import_module("google_crc32c").value  # type: ignore[no-any-return]

    def awscrt() -> Callable[[bytes], int]:
        return importlib.import_module("awscrt.checksums").crc32c  # type: ignore[no-any-return]

    def fastcrc() -> Callable[[bytes], int]:
        return importlib.import_module("fastcrc").crc32.iscsi  # type: ignore[no-any-return]

    return {"crc32c": crc32c, "google-crc32c": google, "awscrt": awscrt, "fastcrc": fastcrc}


def measure(func: Callable[[bytes], int], data: bytes, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        func(data)
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def main() -> None:
    data = os.urandom(SIZE)
    expected = 0xE3069283  # CRC32C("123456789"), the check value every library must give
    for name, load in _libraries().items():
        try:
            func = load()
        except ImportError:
            print(f"{name:14} not installed")
            continue
        if func(b"123456789") != expected:
            print(f"{name:14} wrong check value: not CRC32C")
            continue
        print(f"{name:14} {measure(func, data):5.1f} GB/s")


if __name__ == "__main__":
    main()
