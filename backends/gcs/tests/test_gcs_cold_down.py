"""A GCS cold tier that is down never blocks or breaks a save (issue 11): the shared
scenarios of :class:`tierstore.testing.ColdTierContract`, on fake-gcs-server behind the GCS
fault proxy (which denies writes with GCS's 403 and throttles with 429).

The GCS tier's socket timeouts are fixed (30 s connect, 120 s read), so a stalled request
lets go only when the stall ends: the migration stays pending while stalled, and the
contract lifts the stall before it drains (``stall_fails_fast = False``). The proxy itself
is tested here: a mode that silently forwarded would make the contract pass for the wrong
reason.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gcs_fault_proxy import MODES, FaultProxy

from tierstore.testing import COLD_MODES, ColdTierContract, ProxiedCold, assert_stall_ends

HANG = 60.0  # seconds: how long a stalled request may take to let go once the stall ends


class GCSProxiedCold(ProxiedCold):
    """The test's GCS cold tier: reached through ``proxy``, inspected directly."""

    proxy: FaultProxy

    def options(self, *, through_proxy: bool = True) -> dict[str, Any]:
        return {
            "endpoint_url": self.proxy.url if through_proxy else self.endpoint,
            "token": "anon",
            "project": "test",
            "retry": self.retry,
        }

    def requests(self) -> list[Any]:
        return list(self.proxy.log)

    def throttle_uploads(self) -> None:
        self.proxy.inject(429, method="POST", times=10_000)  # every upload: 429
        self.proxy.inject(429, method="PUT", times=10_000)


class TestGCSColdDown(ColdTierContract):
    stall_fails_fast = False

    @pytest.fixture
    def proxied_cold(self, tmp_path: Path, gcs_endpoint: str, gcs_bucket: str) -> Iterator[GCSProxiedCold]:
        proxy = FaultProxy(gcs_endpoint).start()
        cold = GCSProxiedCold(str(tmp_path / "hot"), f"gs://{gcs_bucket}/run", proxy, gcs_endpoint)
        yield cold
        cold.close()


def test_fault_proxy_modes_do_what_they_say(gcs_endpoint: str, gcs_bucket: str) -> None:
    """The proxy itself: without this, a mode that silently forwarded would make the tests
    above pass for the wrong reason."""
    assert MODES == COLD_MODES  # the contract's modes are the proxy's
    proxy = FaultProxy(gcs_endpoint).start()
    port = int(proxy.url.rsplit(":", 1)[1])
    upload = f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=probe"
    read = f"/storage/v1/b/{gcs_bucket}/o/probe?alt=media"

    def ask(method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request(method, path, body=b"x" if method == "POST" else None)
            answer = conn.getresponse()
            return answer.status, answer.read()
        finally:
            conn.close()

    try:
        assert ask("POST", upload)[0] == 200
        proxy.mode = "deny_writes"
        status, body = ask("POST", upload)
        assert status == 403 and json.loads(body)["error"]["code"] == 403
        assert ask("DELETE", f"/storage/v1/b/{gcs_bucket}/o/probe")[0] == 403
        assert ask("GET", read) == (200, b"x")  # reads pass
        proxy.mode = "refuse"
        with pytest.raises(ConnectionRefusedError):
            ask("GET", read)
        proxy.mode = "stall"
        with pytest.raises(TimeoutError):  # accepted, read, never answered
            ask("GET", read, timeout=0.5)
        # The stall ends (healthy again, or the proxy stopped): stalled requests are dropped.
        assert_stall_ends(
            proxy, lambda: ask("GET", read), lambda: setattr(proxy, "mode", "healthy"), hang=HANG
        )
        assert ask("GET", read) == (200, b"x")  # listening again, on the same port
        assert_stall_ends(proxy, lambda: ask("GET", read), proxy.stop, hang=HANG)
    finally:
        proxy.stop()
