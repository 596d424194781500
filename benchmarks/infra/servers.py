"""Storage servers for the benchmarks, each in its own process so that its Python threads
never share a GIL with the code being measured: moto's S3 server, and delaying proxies.

``python -m benchmarks.infra.servers`` starts moto on 127.0.0.1, prints its URL and serves until
its standard input closes (the parent's exit closes it, so no server outlives a run).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

REGION = "us-west-2"  # bucket creation in us-east-1 fails on moto
# moto completes a multipart upload by joining its parts in Python: for objects of a GiB
# or more that can outlast botocore's 60 s default read timeout. Same for every client.
CLIENT_CONFIG = {"read_timeout": 600, "connect_timeout": 60}
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
}


@dataclass(frozen=True)
class S3Target:
    """One S3 endpoint (moto, or a proxy in front of it) and the benchmark bucket."""

    endpoint: str
    bucket: str

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])

    def fsspec_options(self) -> dict[str, Any]:
        """Storage options for s3fs (DCP's FsspecWriter/Reader, plain put_file)."""
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": REGION},
            "config_kwargs": dict(CLIENT_CONFIG),
        }

    def tier_options(self, **extra: Any) -> dict[str, Any]:
        """Options for tierstore's S3 tier."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "region": REGION,
            "s3fs_options": {"config_kwargs": dict(CLIENT_CONFIG)},
            **extra,
        }

    def to_json(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "bucket": self.bucket}


class ServerProcess:
    """A server child process that prints its URL on its first line of output."""

    def __init__(self, args: list[str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **CREDENTIALS},
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("http"):
            self.stop()
            raise RuntimeError(f"server {args} did not start (printed {line!r})")
        self.url = line

    def stop(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the server exits when its stdin closes
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def start_moto() -> ServerProcess:
    return ServerProcess(["-m", "benchmarks.infra.servers"])


def start_proxy(upstream: str, delay: float) -> ServerProcess:
    return ServerProcess(["-m", "benchmarks.infra.latency_proxy", upstream, str(delay)])


def create_bucket(endpoint: str, bucket: str) -> S3Target:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
    return S3Target(endpoint, bucket)


def reset_moto(endpoint: str) -> None:
    """Drop every bucket and object moto holds (its memory and temp files)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()


def remove_prefix(target: S3Target, url: str) -> None:
    """Delete every object below ``url`` (a benchmark's scratch prefix)."""
    import s3fs

    fs = s3fs.S3FileSystem(**target.fsspec_options(), skip_instance_cache=True)
    try:
        fs.rm(url, recursive=True)
    except FileNotFoundError:
        pass


def serve_until_stdin_closes(host: str, port: int) -> None:
    """The server child's side of :class:`ServerProcess`: announce the URL, then serve
    until the parent closes our stdin (or exits)."""
    print(f"http://{host}:{port}", flush=True)
    sys.stdin.read()


def _serve_moto() -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    serve_until_stdin_closes(*server.get_host_and_port())
    server.stop()


if __name__ == "__main__":
    _serve_moto()
