"""Cold tiers for end-to-end scenarios: the same test against every kind a user has.

Latency is what exposes lifecycle races (a cold tier slower than the saves), so every
scenario that involves the cold tier runs against all of these, real servers only:

* ``local``: a directory (what the suite used to test alone);
* ``s3``: moto's S3 server;
* ``s3-slow``: the same server behind the fault proxy adding ``LATENCY`` seconds to every
  request (a slow link to a healthy bucket);
* ``gcs``: fake-gcs-server.

Use the ``any_cold`` fixture (parametrized over ``KINDS``; tests/conftest.py makes it
visible everywhere) or ``cold_of(request, kind, tmp_path)``. A
:class:`Cold` gives the URL and options the product is handed, a :class:`Tier` that
reaches the server directly (to look behind the product's back), and for the proxied
kinds the proxy, so a test can take the tier down (``cold.down()``).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tierstore.retry import RetryPolicy
from tierstore.tiers.tier import Store, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "s3" / "tests"))

KINDS = ("local", "s3", "s3-slow", "gcs")
LATENCY = 0.03  # seconds per request on s3-slow: tens of ms, a distant region
# Retries short enough that a cold tier taken down fails its uploads in seconds, not minutes.
RETRY = RetryPolicy(attempts=3, deadline=5.0, initial=0.01, maximum=0.1)


@dataclass
class Cold:
    kind: str
    url: str
    options: dict[str, Any]  # what the product is handed (through the proxy, if any)
    direct_options: dict[str, Any]  # straight to the server: for the test's own checks
    proxy: Any = None
    _direct: Tier | None = field(default=None, repr=False)

    def store(self, hot: str | Path) -> Store:
        return Store(str(hot), self.url, cold_options=self.options)

    @property
    def tier(self) -> Tier:
        """The cold tier as the test sees it (no proxy, no faults)."""
        if self._direct is None:
            self._direct = Tier("cold", self.url, self.direct_options)
        return self._direct

    def down(self, mode: str = "refuse") -> None:
        """Take the cold tier down for the product (``refuse``, ``stall``, ``deny_writes``)."""
        if self.proxy is None:
            pytest.skip(f"the {self.kind} cold tier has no proxy to take down")
        self.proxy.mode = mode

    def up(self) -> None:
        if self.proxy is not None:
            self.proxy.mode = "healthy"


def cold_of(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> Iterator[Cold]:
    """A fresh, empty cold tier of ``kind`` for one test."""
    if kind == "local":
        yield Cold(kind, str(tmp_path / "cold"), {}, {})
        return
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    if kind in ("s3", "s3-slow"):
        pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        base = {"key": "testing", "secret": "testing", "region": "us-west-2", "retry": RETRY}
        if kind == "s3":
            yield Cold(
                kind,
                f"s3://{bucket}/{prefix}",
                {**base, "endpoint_url": endpoint},
                {**base, "endpoint_url": endpoint},
            )
            return
        from s3_fault_proxy import FaultProxy

        proxy = FaultProxy(endpoint)
        proxy.add("delay", delay=LATENCY, times=10**9)
        try:
            yield Cold(
                kind,
                f"s3://{bucket}/{prefix}",
                {**base, "endpoint_url": proxy.url},
                {**base, "endpoint_url": endpoint},
                proxy,
            )
        finally:
            proxy.close()
        return
    if kind == "gcs":
        pytest.importorskip("tierstore_gcs", reason="the GCS backend is installed by make test")
        endpoint = request.getfixturevalue("gcs_endpoint")
        bucket = request.getfixturevalue("gcs_bucket")
        options = {"endpoint_url": endpoint, "token": "anon", "project": "test", "retry": RETRY}
        yield Cold(kind, f"gs://{bucket}/{prefix}", options, dict(options))
        return
    raise ValueError(f"unknown cold tier kind {kind!r}")


@pytest.fixture(params=KINDS)
def any_cold(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    yield from cold_of(request, request.param, tmp_path)
