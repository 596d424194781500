"""Fixtures for the GCS tier's tests: the root conftest's fake-gcs-server, plus a fault proxy."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # gcs_fault_proxy

from gcs_fault_proxy import FaultProxy

from tierstore.retry import RetryPolicy
from tierstore_gcs import GCSBackend

SMALL_PART = 256 << 10  # the smallest part GCS allows: resumable uploads from 256 KiB + 1 byte


@pytest.fixture
def fast_retry() -> RetryPolicy:
    """The default policy's shape, with backoffs short enough for tests."""
    return RetryPolicy(attempts=6, deadline=30.0, initial=0.01, maximum=0.05)


@pytest.fixture
def fault_proxy(gcs_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(gcs_endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def direct(gcs_bucket: str) -> GCSBackend:
    """The tier, talking to the emulator directly (configured from the environment)."""
    return GCSBackend(f"gs://{gcs_bucket}/faults")


@pytest.fixture
def proxied(gcs_bucket: str, fault_proxy: FaultProxy, fast_retry: RetryPolicy) -> GCSBackend:
    """The same tier and bucket, through the fault proxy."""
    return GCSBackend(
        f"gs://{gcs_bucket}/faults", endpoint_url=fault_proxy.url, part_size=SMALL_PART, retry=fast_retry
    )
