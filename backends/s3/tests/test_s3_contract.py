"""The backend contract (tierstore.testing) against moto, on a fresh bucket and prefix."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_test_support import FAST_RETRY, PART, MiB, create_bucket

from tierstore.testing import BackendContract
from tierstore_s3 import S3Backend


class TestS3Contract(BackendContract):
    versions = True
    # part_size 5 MiB x (max_concurrency 2 + 1) bounds a write near 15 MiB; a read holds
    # two 5 MiB ranges. 24 MiB streams through more parts than may be in flight at once.
    large_size = 24 * MiB
    stream_memory_limit = 20 * MiB

    @pytest.fixture
    def backend(self, s3_endpoint_own_process: str) -> Iterator[S3Backend]:
        # moto runs in its own process here: the streaming test's tracemalloc would
        # otherwise count the server's copies of the object as the client's.
        bucket = create_bucket(s3_endpoint_own_process)
        backend = S3Backend(
            f"s3://{bucket}/contract/run",
            endpoint_url=s3_endpoint_own_process,
            key="testing",
            secret="testing",
            region="us-west-2",
            part_size=PART,
            max_concurrency=2,
            retry=FAST_RETRY,
        )
        yield backend
        backend.close()
