"""The cold-tier contract as a pytest suite: :class:`ColdTierContract` and the fault proxy it
drives, :class:`ProxiedCold` (see :mod:`tierstore.testing`). Saves, loads and migrates for
real, so it imports torch and the whole of tierstore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore.dcp.reader import TieredReader
from tierstore.dcp.writer import TieredWriter
from tierstore.format import layout
from tierstore.manager import CheckpointManager
from tierstore.migration import migrator as migrator_module
from tierstore.migration.jobs import Job, JobFailed, MigrationOptions, MigrationState
from tierstore.migration.migrator import Migrator
from tierstore.migration.status import migrate_pending
from tierstore.migration.workers import active_migrators
from tierstore.retry import RetryPolicy
from tierstore.testing.backend_contract import returns_within
from tierstore.testing.server_modes import MODES, ServerModes
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.tier import Store, Tier

__all__ = ["COLD_MODES", "ColdTierContract", "ProxiedCold"]

T = TypeVar("T")


COLD_MODES = MODES  # what every backend's fault proxy can be switched to (server_modes)

_HANG = 60.0  # seconds: far beyond any hot save here; only a save blocked on the cold tier gets there
_ONE_TRY = RetryPolicy(attempts=1, deadline=5.0, initial=0.01, maximum=0.05)
_FAST_MIGRATION = MigrationOptions(retry=_ONE_TRY, commit_timeout=5.0, poll_interval=0.05)


class ProxiedCold:
    """A cold tier behind a fault proxy, for :class:`ColdTierContract`.

    ``hot`` is a fresh local directory per test (migrators are cached by hot and cold tier);
    ``url`` is the cold tier's; ``proxy`` switches between :data:`COLD_MODES`
    (:class:`~tierstore.testing.server_modes.ServerModes`) in front of the server at
    ``endpoint``. A backend's suite implements the rest: ``options`` (through the proxy,
    or straight to the server), ``requests`` (what reached the proxy) and
    ``throttle_uploads``.
    """

    retry = _ONE_TRY  # the policy ``options`` should give the tier: one try, short backoffs

    def __init__(self, hot: str, url: str, proxy: ServerModes, endpoint: str) -> None:
        self.hot = hot
        self.url = url
        self.proxy = proxy
        self.endpoint = endpoint

    def set_mode(self, mode: str) -> None:
        self.proxy.mode = mode

    def options(self, *, through_proxy: bool = True) -> dict[str, Any]:
        raise NotImplementedError

    def requests(self) -> list[Any]:
        """Every request that reached the proxy."""
        raise NotImplementedError

    def throttle_uploads(self) -> None:
        """From now on every upload request is answered with the service's throttling error."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the proxy: stalled requests are dropped, connections refused. Idempotent."""
        self.proxy.close()

    def direct(self) -> Tier:
        return Tier("cold", self.url, self.options(through_proxy=False))

    def migrators(self) -> list[Migrator]:
        return [m for m in active_migrators() if m.hot.url == self.hot]

    def drain(self) -> None:
        for migrator in self.migrators():
            assert migrator.wait(_HANG), "the background migrator did not finish its jobs"


def _state_for(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 256, generator=gen), "b": torch.arange(step, step + 1000)}


def _blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(128, 256), "b": torch.zeros(1000, dtype=torch.int64)}


def _returns(fn: Callable[[], T], what: str) -> T:
    return returns_within(fn, _HANG, what)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _load_hot(hot: str, step: int) -> dict[str, torch.Tensor]:
    target = _blank()
    dcp_load(target, storage_reader=TieredReader(hot, step=step))
    return target


def _load_cold_alone(cold: ProxiedCold, step: int) -> dict[str, torch.Tensor]:
    target = _blank()
    reader = TieredReader(Store.of(None, cold.url, cold_options=cold.options(through_proxy=False)), step=step)
    dcp_load(target, storage_reader=reader)
    return target


def _assert_committed_hot(cold: ProxiedCold, steps: list[int], *, kept: list[int] | None = None) -> None:
    """``steps`` are committed on hot and load bit-exact from it; ``kept``: those that must
    still be there (hot pruning may already have removed the others, once migrated)."""
    on_hot = [c.step for c in list_checkpoints(cold.hot)]
    assert set(kept if kept is not None else steps) <= set(on_hot) <= set(steps), on_hot
    for step in on_hot:
        assert step is not None
        _assert_same(_load_hot(cold.hot, step), _state_for(step))


def _writer(cold: ProxiedCold, step: int) -> TieredWriter:
    return TieredWriter(
        Store.of(cold.hot, cold.url, cold_options=cold.options()), step=step, migration=_FAST_MIGRATION
    )


class ColdTierContract:
    """A cold tier that is down never blocks or breaks a save (issue 11), and a second
    migrator never deletes what the first committed (issue 12).

    The cold tier sits behind a fault proxy in each of :data:`COLD_MODES`. In every mode a
    save (``dcp.save``, ``dcp.async_save``, a ``CheckpointManager``) commits on the hot tier
    and loads back from it bit-exact; the migration stays visibly unfinished (failed, or
    pending while stalled) where training looks; once the fault is lifted
    ``migrate_pending`` finishes it, and the checkpoint loads from the cold tier alone.
    Building a writer or a manager sends the cold tier nothing. Saves run on a thread joined
    with a generous timeout: a hang detector, not a timing assertion.

    Subclasses provide the ``proxied_cold`` fixture (a :class:`ProxiedCold`). The class
    attribute ``stall_fails_fast`` says how the tier's client meets a stall: ``True`` (the
    tier's options set short client timeouts while stalled, as the S3 suite does) and its
    requests fail, so the migration fails while the stall lasts; ``False`` (fixed socket
    timeouts, as GCS's) and they wait until the stall ends, so the migration stays pending
    and the tests lift the stall before they drain the migrator. The proxy itself is the
    backend's to test: a mode that silently forwarded would pass these tests for the wrong
    reason.
    """

    stall_fails_fast = True

    @pytest.fixture
    def proxied_cold(self) -> ProxiedCold:
        raise NotImplementedError("subclasses provide the cold tier behind a fault proxy")

    @pytest.fixture(autouse=True)
    def _settle(self, proxied_cold: ProxiedCold, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        # A failing migration must not hold the test process at exit (atexit drain).
        monkeypatch.setenv("TIERSTORE_EXIT_WAIT", "0")
        yield
        proxied_cold.close()  # drops stalled requests; from now on connections are refused
        for migrator in proxied_cold.migrators():
            migrator.wait(_HANG)

    def _waits_out_a_stall(self, mode: str) -> bool:
        return mode == "stall" and not self.stall_fails_fast

    def _assert_migration(self, cold: ProxiedCold, mode: str, steps: list[int]) -> None:
        """Healthy: migrated. Down: unfinished, visibly; then lifted, migrate_pending finishes it."""
        names = {layout.default_name(step) for step in steps}
        direct = cold.direct()
        if self._waits_out_a_stall(mode):
            # Still waiting on an answer that will not come: pending, with the lag showing.
            pending = {s.name for m in cold.migrators() for s in m.pending()}
            assert pending and pending <= names
            assert all(direct.find_manifest(name) is None for name in names)
            cold.set_mode("healthy")  # the stalled requests are dropped unanswered
        cold.drain()
        statuses = [s for m in cold.migrators() for s in m.status()]
        assert {s.name for s in statuses} == names
        if mode == "healthy":
            assert all(s.state is MigrationState.COMMITTED for s in statuses), statuses
        else:
            failed = [s for s in statuses if s.state is MigrationState.FAILED]
            assert all(s.error for s in failed), statuses
            if self._waits_out_a_stall(mode):
                # The jobs ran on once the stall was lifted: failed (the dropped request) or done.
                done = (MigrationState.FAILED, MigrationState.COMMITTED)
                assert all(s.state in done for s in statuses), statuses
            else:  # every job failed and says why
                assert len(failed) == len(statuses), statuses
                assert all(direct.find_manifest(name) is None for name in names)
            cold.set_mode("healthy")
            finished = _returns(
                lambda: migrate_pending(Store.of(cold.hot, cold.url, cold_options=cold.options())),
                "migrate_pending",
            )
            assert sorted(s.name for s in finished) == sorted(s.name for s in failed)
            assert all(s.state is MigrationState.COMMITTED for s in finished), finished
        for step in steps:
            assert direct.find_manifest(layout.default_name(step)) is not None
            _assert_same(_load_cold_alone(cold, step), _state_for(step))

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_save_commits_on_hot_whatever_the_cold_tier_does(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        proxied_cold.set_mode(mode)
        _returns(lambda: dcp_save(_state_for(1), storage_writer=_writer(proxied_cold, 1)), "dcp.save")
        assert Tier("hot", proxied_cold.hot).find_manifest(layout.default_name(1)) is not None
        _assert_committed_hot(proxied_cold, [1])
        self._assert_migration(proxied_cold, mode, [1])

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_async_save_commits_on_hot_whatever_the_cold_tier_does(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        proxied_cold.set_mode(mode)

        def save() -> None:
            future = dcp_async_save(_state_for(2), storage_writer=_writer(proxied_cold, 2))
            assert isinstance(future, Future)  # no async_stager given: a plain future
            future.result()

        _returns(save, "dcp.async_save(...).result()")
        _assert_committed_hot(proxied_cold, [2])
        self._assert_migration(proxied_cold, mode, [2])

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_manager_saves_every_step_and_reports_the_cold_tier(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        cold = proxied_cold
        cold.set_mode(mode)
        manager = _returns(
            lambda: CheckpointManager(
                Store(cold.hot, cold.url, cold_options=cold.options()),
                save_every=1,
                migration=_FAST_MIGRATION,
            ),
            "CheckpointManager()",
        )

        def train() -> None:
            for step in (1, 2, 3):
                manager.save(step, _state_for(step))
            manager.wait(migrations=False)

        _returns(train, "CheckpointManager.save x3 + wait(migrations=False)")
        # The hot policy keeps the last 2; a checkpoint the cold tier never confirmed is kept
        # too, so with the cold tier down all three stay.
        _assert_committed_hot(cold, [1, 2, 3], kept=[2, 3] if mode == "healthy" else [1, 2, 3])
        if self._waits_out_a_stall(mode):
            health = manager.health()  # where training looks: the stall shows as lag
            assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 0, 3), health
            assert health.last_error is None, health
            assert health.migrations_pending and health.migration_lag_bytes > 0, health
        else:
            cold.drain()
            health = manager.health()  # where training looks: the failures are there, not silent
            assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 0, 3), health
            assert health.last_error is None and health.migrations_pending == 0, health
            if mode == "healthy":
                assert health.ok and not health.migrations_failed, health
            else:
                assert not health.ok, health
                assert sorted(s.step or 0 for s in health.migrations_failed) == [1, 2, 3], health
                assert all(s.error for s in health.migrations_failed), health
        self._assert_migration(cold, mode, [1, 2, 3])
        _returns(manager.close, "CheckpointManager.close()")

    @pytest.mark.parametrize("mode", ("stall", "refuse"))
    def test_building_writer_and_manager_never_touches_the_cold_tier(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        cold = proxied_cold
        cold.set_mode(mode)
        built = _returns(lambda: _writer(cold, 1), "TieredWriter()")
        assert built.cold is not None
        manager = _returns(
            lambda: CheckpointManager(
                Store(cold.hot, cold.url, cold_options=cold.options()), migration=_FAST_MIGRATION
            ),
            "CheckpointManager()",
        )
        # Nor later: the round a manager starts in the background to resume pending
        # migrations has nothing to hold against the cold tier in an empty hot tier.
        started = manager._maintenance.running()
        if started is not None:
            started.result(timeout=10)
        assert cold.requests() == []  # not a single request reached the cold tier

    def test_a_throttled_second_migrator_never_deletes_a_committed_object(
        self, proxied_cold: ProxiedCold, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cold = proxied_cold
        dcp_save(_state_for(1), storage_writer=TieredWriter(cold.hot, step=1))
        done = migrate_pending(
            Store.of(cold.hot, cold.url, cold_options=cold.options(through_proxy=False)),
            config=_FAST_MIGRATION,
        )
        assert done[0].state is MigrationState.COMMITTED
        manifest = Tier("hot", cold.hot).find_manifest(layout.default_name(1))
        assert manifest is not None
        cold.throttle_uploads()
        second = Migrator(Tier("hot", cold.hot), Tier("cold", cold.url, cold.options()), _FAST_MIGRATION)
        try:
            for entry in manifest.files:
                job = Job(manifest.name, manifest.attempt, manifest.step, entry.rank, (entry,), 0.0)
                # A second migrator that looked before the first one wrote found no verified
                # copy. Before: each retry deleted the key first, so the committed object was gone.
                with monkeypatch.context() as patch:
                    patch.setattr(migrator_module, "verified_copy", lambda *a, **k: None)
                    with pytest.raises(JobFailed):
                        second._upload_file(job, entry, {})
        finally:
            second.close()
        _assert_same(_load_cold_alone(cold, 1), _state_for(1))
