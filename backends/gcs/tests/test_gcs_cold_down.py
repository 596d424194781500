"""A GCS cold tier that is down never blocks or breaks a save (issue 11).

The cold tier sits behind a fault proxy in front of fake-gcs-server that is healthy,
refuses connections, stalls (accepts, reads, never answers) or denies writes (GCS's 403).
In every mode a save commits on the hot tier and loads back from it bit-exact, the
migration stays visibly unfinished (failed, or pending while stalled), and once the fault
is lifted ``migrate_pending`` finishes it: the checkpoint then loads from the cold tier
alone. Nothing is lost.

Saves run on a thread joined with a generous timeout: a hang detector, not a timing
assertion. The GCS tier's socket timeouts are fixed (30 s connect, 120 s read), so a
stalled request lets go only when the stall ends: the tests lift it before draining.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gcs_fault_proxy import MODES, FaultProxy

from tierstore import TieredReader, TieredWriter
from tierstore.format import layout
from tierstore.manager import CheckpointManager
from tierstore.retry import RetryPolicy
from tierstore.testing import in_background, returns_within
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.migrator import Job, MigrationConfig, MigrationState, Migrator
from tierstore.tiers.status import migrate_pending
from tierstore.tiers.tier import Tier
from tierstore.tiers.workers import active_migrators

T = TypeVar("T")
HANG = 60.0  # seconds: far beyond any hot save here; only a save blocked on GCS gets there
ONE_TRY = RetryPolicy(attempts=1, deadline=5.0, initial=0.01, maximum=0.05)
FAST_MIGRATION = MigrationConfig(retry=ONE_TRY, commit_timeout=5.0, poll_interval=0.05)


def state_for(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 256, generator=gen), "b": torch.arange(step, step + 1000)}


def blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(128, 256), "b": torch.zeros(1000, dtype=torch.int64)}


def returns(fn: Callable[[], T], what: str) -> T:
    """``fn()``, run on a thread; fails the test if it has not returned after ``HANG`` s."""
    return returns_within(fn, HANG, what)


class ColdTier:
    """The test's GCS cold tier: reached through ``proxy``, inspected directly."""

    def __init__(self, tmp_path: Path, proxy: FaultProxy, endpoint: str, bucket: str) -> None:
        self.hot = str(tmp_path / "hot")  # fresh per test: migrators are cached by (hot, cold)
        self.url = f"gs://{bucket}/run"
        self.proxy = proxy
        self._endpoint = endpoint

    def options(self, *, through_proxy: bool = True) -> dict[str, Any]:
        return {
            "endpoint_url": self.proxy.url if through_proxy else self._endpoint,
            "token": "anon",
            "project": "test",
            "retry": ONE_TRY,
        }

    def direct(self) -> Tier:
        return Tier("cold", self.url, self.options(through_proxy=False))

    def migrators(self) -> list[Migrator]:
        return [m for m in active_migrators() if m.hot.url == self.hot]

    def drain(self) -> None:
        for migrator in self.migrators():
            assert migrator.wait(HANG), "the background migrator did not finish its jobs"


@pytest.fixture
def cold(
    tmp_path: Path, gcs_endpoint: str, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ColdTier]:
    # A failing migration must not hold the test process at exit (atexit drain).
    monkeypatch.setenv("TIERSTORE_EXIT_WAIT", "0")
    proxy = FaultProxy(gcs_endpoint).start()
    tier = ColdTier(tmp_path, proxy, gcs_endpoint, gcs_bucket)
    try:
        yield tier
    finally:
        proxy.stop()  # drops stalled requests; from now on connections are refused
        for migrator in tier.migrators():
            migrator.wait(HANG)


def load_hot(hot: str, step: int) -> dict[str, torch.Tensor]:
    target = blank()
    dcp.load(target, storage_reader=TieredReader(hot, step=step))
    return target


def load_cold_alone(cold: ColdTier, step: int) -> dict[str, torch.Tensor]:
    target = blank()
    dcp.load(
        target,
        storage_reader=TieredReader(
            None, cold.url, step=step, cold_options=cold.options(through_proxy=False)
        ),
    )
    return target


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def assert_committed_hot(cold: ColdTier, steps: list[int], *, kept: list[int] | None = None) -> None:
    """``steps`` are committed on hot and load bit-exact from it; ``kept``: those that must
    still be there (hot pruning may already have removed the others, once migrated)."""
    on_hot = [c.step for c in list_checkpoints(cold.hot)]
    assert set(kept if kept is not None else steps) <= set(on_hot) <= set(steps), on_hot
    for step in on_hot:
        assert step is not None
        assert_same(load_hot(cold.hot, step), state_for(step))


def assert_migration(cold: ColdTier, mode: str, steps: list[int]) -> None:
    """Healthy: migrated. Down: unfinished, visibly; then lifted, migrate_pending finishes it."""
    names = {layout.default_name(step) for step in steps}
    direct = cold.direct()
    if mode == "stall":
        # Still waiting on an answer that will not come: pending, with the lag showing.
        pending = {s.name for m in cold.migrators() for s in m.pending()}
        assert pending and pending <= names
        assert all(direct.find_manifest(name) is None for name in names)
        cold.proxy.mode = "healthy"  # the stalled requests are dropped unanswered
    cold.drain()
    statuses = [s for m in cold.migrators() for s in m.status()]
    assert {s.name for s in statuses} == names
    if mode == "healthy":
        assert all(s.state is MigrationState.COMMITTED for s in statuses), statuses
    else:
        # Refused or denied: every job failed and says why. Stalled: the jobs ran on once
        # the stall was lifted, and either failed (the dropped request) or completed.
        failed = [s for s in statuses if s.state is MigrationState.FAILED]
        assert all(s.error for s in failed), statuses
        if mode != "stall":
            assert len(failed) == len(statuses), statuses
            assert all(direct.find_manifest(name) is None for name in names)
        else:
            assert all(s.state in (MigrationState.FAILED, MigrationState.COMMITTED) for s in statuses), (
                statuses
            )
        cold.proxy.mode = "healthy"
        finished = returns(
            lambda: migrate_pending(cold.hot, cold.url, cold_options=cold.options()), "migrate_pending"
        )
        assert {s.name for s in finished} == {s.name for s in failed}
        assert all(s.state is MigrationState.COMMITTED for s in finished), finished
    for step in steps:
        assert direct.find_manifest(layout.default_name(step)) is not None
        assert_same(load_cold_alone(cold, step), state_for(step))


def writer(cold: ColdTier, step: int) -> TieredWriter:
    return TieredWriter(cold.hot, cold.url, step=step, cold_options=cold.options(), migration=FAST_MIGRATION)


@pytest.mark.parametrize("mode", MODES)
def test_save_commits_on_hot_whatever_the_cold_tier_does(cold: ColdTier, mode: str) -> None:
    cold.proxy.mode = mode
    returns(lambda: dcp.save(state_for(1), storage_writer=writer(cold, 1)), "dcp.save")
    assert Tier("hot", cold.hot).find_manifest(layout.default_name(1)) is not None
    assert_committed_hot(cold, [1])
    assert_migration(cold, mode, [1])


@pytest.mark.parametrize("mode", MODES)
def test_async_save_commits_on_hot_whatever_the_cold_tier_does(cold: ColdTier, mode: str) -> None:
    cold.proxy.mode = mode
    returns(
        lambda: dcp.async_save(state_for(2), storage_writer=writer(cold, 2)).result(),
        "dcp.async_save(...).result()",
    )
    assert_committed_hot(cold, [2])
    assert_migration(cold, mode, [2])


@pytest.mark.parametrize("mode", MODES)
def test_manager_saves_every_step_and_reports_the_cold_tier(cold: ColdTier, mode: str) -> None:
    cold.proxy.mode = mode
    manager = returns(
        lambda: CheckpointManager(
            cold.hot, cold.url, save_every=1, cold_options=cold.options(), migration=FAST_MIGRATION
        ),
        "CheckpointManager()",
    )

    def train() -> None:
        for step in (1, 2, 3):
            manager.save(step, state_for(step))
        manager.wait(migrations=False)

    returns(train, "CheckpointManager.save x3 + wait(migrations=False)")
    # The hot policy keeps the last 2; a checkpoint the cold tier never confirmed is kept
    # too, so with the cold tier down all three stay.
    assert_committed_hot(cold, [1, 2, 3], kept=[2, 3] if mode == "healthy" else [1, 2, 3])
    health = manager.health()  # where training looks: the cold tier's trouble shows there
    assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 0, 3), health
    assert health.last_error is None, health
    if mode == "stall":
        assert health.migrations_pending and health.migration_lag_bytes > 0, health
    assert_migration(cold, mode, [1, 2, 3])  # drains, lifts the fault, migrates the rest
    if mode in ("refuse", "deny_writes"):
        failed = manager.health().migrations_failed
        assert sorted(s.step or 0 for s in failed) == [1, 2, 3] and all(s.error for s in failed)
    returns(manager.close, "CheckpointManager.close()")


@pytest.mark.parametrize("mode", ("stall", "refuse"))
def test_building_writer_and_manager_never_touches_the_cold_tier(cold: ColdTier, mode: str) -> None:
    cold.proxy.mode = mode
    built = returns(lambda: writer(cold, 1), "TieredWriter()")
    assert built.cold is not None
    returns(
        lambda: CheckpointManager(cold.hot, cold.url, cold_options=cold.options(), migration=FAST_MIGRATION),
        "CheckpointManager()",
    )
    assert cold.proxy.log == []  # not a single request reached the cold tier


def test_fault_proxy_modes_do_what_they_say(gcs_endpoint: str, gcs_bucket: str) -> None:
    """The proxy itself: without this, a mode that silently forwarded would make the tests
    above pass for the wrong reason."""
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
        waiter, box = in_background(lambda: ask("GET", read))
        waiter.join(0.5)
        assert waiter.is_alive()  # still stalled
        proxy.mode = "healthy"  # the stall ends: the stalled request is dropped unanswered
        waiter.join(HANG)
        assert not waiter.is_alive() and "error" in box, box
        assert ask("GET", read) == (200, b"x")  # listening again, on the same port
        proxy.mode = "stall"
        waiter, box = in_background(lambda: ask("GET", read))
        waiter.join(0.5)
        proxy.stop()  # stopping lets stalled requests go too
        waiter.join(HANG)
        assert not waiter.is_alive() and "error" in box, box
    finally:
        proxy.stop()


# -- issue 12: a second migrator never undoes the first ---------------------------------------


def _upload_as_a_racing_migrator(
    migrator: Migrator, job: Any, entry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upload ``entry`` as a second migrator that looked before the first one wrote (so it
    found no verified copy) would."""
    import tierstore.tiers.migrator as migrator_mod

    with monkeypatch.context() as patch:
        patch.setattr(migrator_mod, "verified_copy", lambda *a, **k: None)
        migrator._upload_file(job, entry, {})


def test_a_throttled_second_migrator_never_deletes_a_committed_object(
    cold: ColdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierstore.tiers.migrator as migrator_mod

    dcp.save(state_for(1), storage_writer=TieredWriter(cold.hot, step=1))
    done = migrate_pending(
        cold.hot, cold.url, cold_options=cold.options(through_proxy=False), config=FAST_MIGRATION
    )
    assert done[0].state is MigrationState.COMMITTED
    manifest = Tier("hot", cold.hot).find_manifest("step-0000000001")
    assert manifest is not None
    cold.proxy.inject(429, method="POST", times=10_000)  # every upload: 429
    cold.proxy.inject(429, method="PUT", times=10_000)
    second = Migrator(Tier("hot", cold.hot), Tier("cold", cold.url, cold.options()), FAST_MIGRATION)
    try:
        for entry in manifest.files:
            job = Job(manifest.name, manifest.attempt, manifest.step, entry.rank, (entry,), 0.0)
            # Before: each retry deleted the key first, so the committed object was gone.
            with pytest.raises(migrator_mod._Failed):
                _upload_as_a_racing_migrator(second, job, entry, monkeypatch)
    finally:
        second.close()
    assert_same(load_cold_alone(cold, 1), state_for(1))
