"""Cold tiers for end-to-end scenarios: the same test against every kind a user has.

Latency is what exposes lifecycle races (a cold tier slower than the saves), so every
scenario that involves the cold tier runs against all of these, real servers only:

* ``local``: a directory (what the suite used to test alone);
* ``s3``: moto's S3 server;
* ``s3-slow``: the same server behind the fault proxy adding ``LATENCY`` seconds to every
  request (a slow link to a healthy bucket);
* ``gcs``: fake-gcs-server.

Use the ``any_cold`` fixture (parametrized over ``KINDS``; tests/conftest.py makes it
visible everywhere) or ``cold_of(request, kind, tmp_path)``; ``switchable_cold`` gives
every kind a way down and back (a local tier whose mount goes away, the object stores
behind a fault proxy), for a cold tier that blips. A
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


class LocalSwitch:
    """A local cold tier that can be taken away and brought back, as a mount that goes away
    does: ``mode = "refuse"`` moves the directory above the tier aside and puts a file in
    its place (every write fails; a listing finds nothing), ``"healthy"`` puts it back, its
    content intact. The local kind's stand-in for a proxy's whole-server modes."""

    def __init__(self, mount: Path) -> None:
        self.mount, self.away = mount, mount.with_name(mount.name + ".away")
        self.mount.mkdir(parents=True, exist_ok=True)
        self._mode = "healthy"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in ("healthy", "refuse"):
            pytest.skip(f"a local cold tier cannot be put in mode {mode!r}")
        if mode == self._mode:
            return
        if mode == "refuse":
            self.mount.rename(self.away)
            self.mount.write_text("a file where the cold tier's mount should be")
        else:
            self.mount.unlink()
            self.away.rename(self.mount)
        self._mode = mode


def cold_of(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path, *, switchable: bool = False
) -> Iterator[Cold]:
    """A fresh, empty cold tier of ``kind`` for one test; ``switchable``: one that
    :meth:`Cold.down` can take down and :meth:`Cold.up` bring back, whatever its kind (a
    local tier through :class:`LocalSwitch`, the object stores behind a fault proxy)."""
    if kind == "local":
        if switchable:
            switch = LocalSwitch(tmp_path / "cold-mount")
            try:
                yield Cold(kind, str(switch.mount / "cold"), {}, {}, switch)
            finally:
                switch.mode = "healthy"
            return
        yield Cold(kind, str(tmp_path / "cold"), {}, {})
        return
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    if kind in ("s3", "s3-slow"):
        pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        base = {"key": "testing", "secret": "testing", "region": "us-west-2", "retry": RETRY}
        if kind == "s3" and not switchable:
            yield Cold(
                kind,
                f"s3://{bucket}/{prefix}",
                {**base, "endpoint_url": endpoint},
                {**base, "endpoint_url": endpoint},
            )
            return
        from s3_fault_proxy import FaultProxy

        proxy = FaultProxy(endpoint)
        if kind == "s3-slow":
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
        if not switchable:
            yield Cold(kind, f"gs://{bucket}/{prefix}", options, dict(options))
            return
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "gcs" / "tests"))
        from gcs_fault_proxy import FaultProxy as GcsProxy

        gcs_proxy = GcsProxy(endpoint)
        try:
            yield Cold(
                kind,
                f"gs://{bucket}/{prefix}",
                {**options, "endpoint_url": gcs_proxy.url},
                options,
                gcs_proxy,
            )
        finally:
            gcs_proxy.close()
        return
    raise ValueError(f"unknown cold tier kind {kind!r}")


@pytest.fixture(params=KINDS)
def any_cold(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    yield from cold_of(request, request.param, tmp_path)


@pytest.fixture(params=KINDS)
def switchable_cold(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    """Every kind, each one that ``down()`` takes down and ``up()`` brings back."""
    yield from cold_of(request, request.param, tmp_path, switchable=True)
