"""Constants and helpers shared by the S3 backend tests (a uniquely named module: every
``conftest`` in the repository is importable only by pytest, not by name)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import boto3

from tierstore.retry import RetryPolicy

__all__ = ["MiB", "PART", "FAST_RETRY", "create_bucket", "moto_in_own_process"]

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: multipart paths run on small objects
# The real backoff's shape with tiny waits: no test sleeps on a real backoff (docs/design.md, Conventions).
FAST_RETRY = RetryPolicy(attempts=6, deadline=30.0, initial=0.005, maximum=0.05)


def create_bucket(endpoint: str) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-west-2",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    return name


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
