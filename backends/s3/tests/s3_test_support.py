"""Constants and helpers shared by the S3 backend tests (a uniquely named module: every
``conftest`` in the repository is importable only by pytest, not by name)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierstore.retry import RetryPolicy

__all__ = ["MiB", "PART", "FAST_RETRY", "backend_options", "moto_in_own_process"]

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: multipart paths run on small objects
# The real backoff's shape with tiny waits: no test sleeps on a real backoff (docs/design.md, Conventions).
FAST_RETRY = RetryPolicy(attempts=6, deadline=30.0, initial=0.005, maximum=0.05)


def backend_options(endpoint: str) -> dict[str, Any]:
    """What every test's S3 backend is built with, on the moto server at ``endpoint``."""
    return dict(
        endpoint_url=endpoint,
        key="testing",
        secret="testing",
        region="us-west-2",
        part_size=PART,
        max_concurrency=2,
        retry=FAST_RETRY,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_in_own_process(timeout: float = 30.0) -> Iterator[str]:
    """A moto S3 server in a child process; yields its URL, stops it on exit."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto server process did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)
