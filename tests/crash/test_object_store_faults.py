"""Object-store faults during migration, injected on the wire between tierstore and moto's
S3 server: 503 SlowDown storms, connections reset mid-upload, latency spikes, and a cold
commit whose answer is lost after it succeeded. Migration finishes with nothing lost, the
training loop's saves never wait for it, and a permanent failure is reported, not raised."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stats import STATS

from tierstore import ReaderOptions, TieredReader, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.scrub import verify_store
from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.retry import RetryPolicy

pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "s3" / "tests"))
from s3_fault_proxy import FaultProxy

from tierstore import Store

MiB = 1 << 20
FAST_RETRY = RetryPolicy(attempts=8, deadline=60, initial=0.01, maximum=0.05)
CONFIG = MigrationOptions(concurrency=2, poll_interval=0.01, commit_timeout=30, retry=FAST_RETRY)


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # 6 MiB: a multipart upload at 5 MiB parts, so resets can hit a part mid-upload
    return {
        "big": torch.randn(6 * MiB // 4, generator=g),
        "small": torch.randn(100, generator=g),
        "extra": {"step": step},
    }


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    server = FaultProxy(s3_endpoint)
    yield server
    server.close()


@pytest.fixture
def proxied_tiers(tmp_path: Path, s3_bucket: str, proxy: FaultProxy) -> dict[str, Any]:
    cold_options = {
        "endpoint_url": proxy.url,
        "key": "testing",
        "secret": "testing",
        "region": "us-west-2",
        "part_size": 5 * MiB,
        "max_concurrency": 2,
        "retry": FAST_RETRY,
    }
    return {"hot": str(tmp_path / "hot"), "cold": f"s3://{s3_bucket}/run", "cold_options": cold_options}


def save(proxied_tiers: dict[str, Any], step: int) -> TieredWriter:
    writer = TieredWriter(
        Store.of(proxied_tiers["hot"], proxied_tiers["cold"], cold_options=proxied_tiers["cold_options"]),
        step=step,
        migration=CONFIG,
    )
    dcp.save(state_for(step), storage_writer=writer)
    return writer


def assert_cold_copy_is_whole(proxied_tiers: dict[str, Any], step: int) -> None:
    target = {"big": torch.zeros(6 * MiB // 4), "small": torch.zeros(100), "extra": {"step": -1}}
    dcp.load(
        target,
        storage_reader=TieredReader(
            Store.of(None, proxied_tiers["cold"], cold_options=proxied_tiers["cold_options"]),
            step=step,
            options=ReaderOptions(lease=False),
        ),
    )
    want = state_for(step)
    assert torch.equal(target["big"], want["big"]) and target["extra"] == {"step": step}
    checks = verify_store(Store(cold=proxied_tiers["cold"], cold_options=proxied_tiers["cold_options"]))
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_slowdown_storm_resets_and_latency_spikes(proxied_tiers: dict[str, Any], proxy: FaultProxy) -> None:
    proxy.add("slowdown", method="PUT", times=12)  # a storm of 503 SlowDown on every upload
    proxy.add("reset", method="PUT", contains=("partNumber",), times=3)  # parts cut mid-upload
    proxy.add("delay", delay=0.3, times=10)  # latency spikes on whatever comes next
    proxy.add("internal", method="GET", times=3)
    STATS.faults += 28
    writer = save(proxied_tiers, 1)
    assert writer.migrator.wait(120)
    [status] = writer.migrator.status()
    assert status.state is MigrationState.COMMITTED, status
    fired = {r.action: r.fired for r in proxy._state.rules}
    assert fired["slowdown"] == 12 and fired["reset"] == 3  # the faults really happened
    assert_cold_copy_is_whole(proxied_tiers, 1)


def test_lost_answer_to_the_cold_commit_is_resolved(proxied_tiers: dict[str, Any], proxy: FaultProxy) -> None:
    # The conditional PUT of the cold manifest reaches S3, but its answer never comes back:
    # the retry meets 412 and must read back to learn the commit was its own.
    rule = proxy.add("lose_answer", method="PUT", contains=(layout.MANIFEST_DIR + "/",))
    STATS.faults += 1
    writer = save(proxied_tiers, 1)
    assert writer.migrator.wait(120)
    assert rule.fired == 1
    [status] = writer.migrator.status()
    assert status.state is MigrationState.COMMITTED, status
    assert [
        c.tiers
        for c in list_checkpoints(
            Store.of(proxied_tiers["hot"], proxied_tiers["cold"], cold_options=proxied_tiers["cold_options"])
        )
    ] == [("hot", "cold")]
    assert_cold_copy_is_whole(proxied_tiers, 1)


def test_saves_never_wait_for_migration(proxied_tiers: dict[str, Any], proxy: FaultProxy) -> None:
    held = proxy.add("delay", method="PUT", delay=5.0, times=1)  # the first upload hangs 5 s
    writer = save(proxied_tiers, 1)
    # dcp.save has returned, yet the first upload is still held up at the proxy.
    pending = writer.migrator.pending()
    assert [s.name for s in pending] == [layout.default_name(1)]
    save(proxied_tiers, 2)  # and the next save goes through meanwhile
    assert writer.migrator.wait(120) and held.fired == 1
    assert {s.state for s in writer.migrator.status()} == {MigrationState.COMMITTED}


def test_permanent_denial_is_reported_and_the_next_save_works(
    proxied_tiers: dict[str, Any], proxy: FaultProxy
) -> None:
    proxy.add("deny", method="PUT", contains=("shards/",), times=100)
    STATS.faults += 1
    writer = save(proxied_tiers, 1)
    assert writer.migrator.wait(120)
    [failed] = writer.migrator.failures()
    assert failed.failed_rank == 0 and failed.failed_file is not None and "AccessDenied" in failed.error
    proxy.reset()
    second = save(proxied_tiers, 2)
    assert second.migrator.wait(120)
    states = {s.name: s.state for s in second.migrator.status()}
    assert states[layout.default_name(2)] is MigrationState.COMMITTED
    assert_cold_copy_is_whole(proxied_tiers, 2)
