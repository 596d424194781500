"""An S3 cold tier that is down never blocks or breaks a save (issue 11): the shared
scenarios of :class:`tierstore.testing.ColdTierContract`, on moto behind the S3 fault proxy.

While stalled, the tier's client timeouts are short, so a stalled request fails in a second
and the migration fails while the stall lasts (``stall_fails_fast``). The proxy itself is
tested here: a mode that silently forwarded would make the contract pass for the wrong reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_fault_proxy import MODES, FaultProxy

from tierstore.testing import COLD_MODES, ColdTierContract, ProxiedCold, assert_stall_ends

HANG = 60.0  # seconds: how long a stalled request may take to let go once the stall ends


class S3ProxiedCold(ProxiedCold):
    """The test's S3 cold tier: reached through ``proxy``, inspected directly on moto."""

    proxy: FaultProxy

    def options(self, *, through_proxy: bool = True) -> dict[str, Any]:
        # Short client timeouts while stalled, so that a stalled request (not the save: it
        # never waits on S3) fails in a second and the test's migrator moves on.
        timeout = 1 if self.proxy.mode == "stall" else 30
        return {
            "endpoint_url": self.proxy.url if through_proxy else self.endpoint,
            "key": "testing",
            "secret": "testing",
            "region": "us-west-2",
            "retry": self.retry,
            "s3fs_options": {"config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout}},
        }

    def requests(self) -> list[Any]:
        return list(self.proxy.seen())

    def throttle_uploads(self) -> None:
        self.proxy.add("slowdown", method="PUT", times=10_000)  # every upload: 503 SlowDown
        self.proxy.add("slowdown", method="POST", times=10_000)


class TestS3ColdDown(ColdTierContract):
    stall_fails_fast = True

    @pytest.fixture
    def proxied_cold(self, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> Iterator[S3ProxiedCold]:
        cold = S3ProxiedCold(
            str(tmp_path / "hot"), f"s3://{s3_bucket}/run", FaultProxy(s3_endpoint), s3_endpoint
        )
        yield cold
        cold.close()


def test_fault_proxy_modes_do_what_they_say(s3_endpoint: str, s3_bucket: str) -> None:
    """The proxy itself: without this, a mode that silently forwarded would make the tests
    above pass for the wrong reason."""
    assert MODES == COLD_MODES  # the contract's modes are the proxy's
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    proxy = FaultProxy(s3_endpoint)

    def client(read_timeout: float = 30.0) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=proxy.url,
            region_name="us-west-2",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=read_timeout),
        )

    def code(call: Callable[[], Any]) -> str:
        with pytest.raises(ClientError) as info:
            call()
        return str(info.value.response["Error"]["Code"])

    s3 = client()
    try:
        s3.put_object(Bucket=s3_bucket, Key="probe", Body=b"x")
        proxy.mode = "deny_writes"
        assert code(lambda: s3.put_object(Bucket=s3_bucket, Key="probe", Body=b"y")) == "AccessDenied"
        assert code(lambda: s3.delete_object(Bucket=s3_bucket, Key="probe")) == "AccessDenied"
        assert s3.get_object(Bucket=s3_bucket, Key="probe")["Body"].read() == b"x"  # reads pass
        proxy.mode = "refuse"
        with pytest.raises(EndpointConnectionError):
            s3.head_object(Bucket=s3_bucket, Key="probe")
        proxy.mode = "stall"
        with pytest.raises(ReadTimeoutError):  # accepted, read, never answered
            client(read_timeout=0.5).head_object(Bucket=s3_bucket, Key="probe")
        # The stall ends (healthy again, or the proxy closed): stalled requests are dropped.
        head = lambda: s3.head_object(Bucket=s3_bucket, Key="probe")
        assert_stall_ends(proxy, head, lambda: setattr(proxy, "mode", "healthy"), hang=HANG)
        assert s3.get_object(Bucket=s3_bucket, Key="probe")["Body"].read() == b"x"  # same URL
        assert_stall_ends(proxy, head, proxy.close, hang=HANG)
    finally:
        proxy.close()
