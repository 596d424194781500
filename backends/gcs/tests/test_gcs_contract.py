"""The backend contract (tierstore.testing) against a real fake-gcs-server."""

from __future__ import annotations

import pytest

from tierstore.testing import BackendContract
from tierstore_gcs import GCSBackend


class TestGCSContract(BackendContract):
    versions = True
    # 16 parts of 1 MiB. Measured: writing holds ~2 MiB (one part, plus ~1 MiB of aiohttp
    # and asyncio buffers whatever the part size), reading ~4 MiB (one block, the same
    # buffers, and the test's own two 1 MiB reads): bounded by the part, not the object.
    large_size = 16 << 20
    stream_memory_limit = 6 << 20

    @pytest.fixture
    def backend(self, gcs_bucket: str) -> GCSBackend:
        return GCSBackend(f"gs://{gcs_bucket}/tier/root", part_size=1 << 20)
