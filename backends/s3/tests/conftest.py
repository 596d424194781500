"""Fixtures for the S3 backend tests: backends on moto (``s3_endpoint``/``s3_bucket`` come
from the root conftest), directly or through a fault-injecting proxy."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from s3_fault_proxy import FaultProxy
from s3_test_support import backend_options, moto_in_own_process

from tierstore_s3 import S3Backend

for noisy in ("werkzeug", "moto", "botocore", "aiobotocore", "s3fs", "urllib3"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def fault_proxy_server(s3_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def fault_proxy(fault_proxy_server: FaultProxy) -> Iterator[FaultProxy]:
    fault_proxy_server.reset()
    yield fault_proxy_server
    fault_proxy_server.reset()


@pytest.fixture
def make_backend(s3_endpoint: str, s3_bucket: str) -> Iterator[Callable[..., S3Backend]]:
    """Backends on the test's bucket: ``make_backend(prefix="run", endpoint=..., **opts)``."""
    made: list[S3Backend] = []

    def make(prefix: str = "run", *, endpoint: str | None = None, **options: Any) -> S3Backend:
        settings = {**backend_options(endpoint or s3_endpoint), **options}
        backend = S3Backend(f"s3://{s3_bucket}/{prefix}", **settings)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def boto_client(s3_endpoint: str) -> Any:
    """A plain boto3 client, to look at the bucket behind the backend's back."""
    boto3 = pytest.importorskip("boto3")
    return boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-west-2",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture(scope="session")
def s3_endpoint_own_process() -> Iterator[str]:
    """moto in a process of its own: memory tests must not count the server's copies
    (tracemalloc sees every allocation in the process, an in-process moto's included)."""
    with moto_in_own_process() as url:
        yield url
