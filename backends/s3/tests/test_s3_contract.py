"""The backend contract (tierstore.testing) against moto, on a fresh bucket and prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from s3_test_support import MiB, backend_options

from tierstore.testing import BackendContract
from tierstore_s3 import S3Backend


class TestS3Contract(BackendContract):
    versions = True
    # part_size 5 MiB x (max_concurrency 2 + 1) bounds a write near 15 MiB; a read holds
    # two 5 MiB ranges. 24 MiB streams through more parts than may be in flight at once.
    large_size = 24 * MiB
    stream_memory_limit = 20 * MiB

    @pytest.fixture
    def backend(
        self, s3_endpoint_own_process: str, make_s3_bucket: Callable[[str], str]
    ) -> Iterator[S3Backend]:
        # moto runs in its own process here: the streaming test's tracemalloc would
        # otherwise count the server's copies of the object as the client's.
        bucket = make_s3_bucket(s3_endpoint_own_process)
        backend = S3Backend(f"s3://{bucket}/contract/run", **backend_options(s3_endpoint_own_process))
        yield backend
        backend.close()
