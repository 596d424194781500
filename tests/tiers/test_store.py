"""``Store``: one value for a store's tiers, accepted by every store-wide call in place of URLs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import blank, matches, state_for

from tierstore import (
    CheckpointManager,
    ConfigError,
    ReaderOptions,
    StagingOptions,
    Store,
    TieredReader,
    TieredWriter,
    collect_garbage,
    keep_last,
    list_checkpoints,
    migration_status,
    prune,
)
from tierstore.migration import workers


def test_store_is_accepted_wherever_urls_are(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    store = Store(hot, cold)
    for step in (1, 2, 3):
        dcp.save(state_for(step), storage_writer=TieredWriter(store, step=step))
    assert workers.drain(60)  # the background migrations settle: both listings see one store
    listed = list_checkpoints(store)
    assert [c.step for c in listed] == [1, 2, 3]
    assert listed == list_checkpoints(Store.of(hot, cold))  # the same store, built again from its URLs
    state = blank()
    reader = TieredReader(store, step=2)
    dcp.load(state, storage_reader=reader)
    assert matches(state, 2) and reader.manifest is not None and reader.manifest.step == 2
    statuses = migration_status(store)
    assert sorted(s.step for s in statuses) == [1, 2, 3]
    # The saves' background migrations done (their commits clear the upload marks), the
    # store holds no garbage; while one commits, its marks are garbage for a moment.
    assert workers.drain(60)
    assert collect_garbage(store).garbage == ()
    reports = prune(store, hot_policy=keep_last(1), cold_policy=keep_last(3))
    assert [r.tier for r in reports] == [f"hot {hot}", f"cold {cold}"]


def test_the_manager_takes_a_store(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "hot"))
    with CheckpointManager(store, save_every=1, staging=StagingOptions(async_save=False)) as manager:
        manager.save(4, state_for(4))
        assert manager.steps() == [4]
        state = blank()
        assert manager.load_latest(state) == 4 and matches(state, 4)


def test_store_and_urls_together_are_refused(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "hot"))
    assert Store.of(store) is store
    with pytest.raises(ConfigError, match="either a Store or tier URLs"):
        Store.of(store, str(tmp_path / "cold"))
    with pytest.raises(ConfigError, match="either a Store or tier URLs"):
        TieredWriter(store, str(tmp_path / "cold"))
    with pytest.raises(ConfigError, match="at least one tier"):
        Store()


def test_a_hot_only_store_cannot_migrate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both a hot and a cold tier"):
        migration_status(Store(str(tmp_path / "hot")))
    with pytest.raises(ConfigError, match="needs a hot tier"):
        TieredWriter(Store(cold=str(tmp_path / "cold")), step=1)


def test_store_pickles_without_backends_and_hides_credentials(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "hot"), "file://" + str(tmp_path / "cold"))
    assert store.hot is not None and store.hot.backend is not None  # opened
    clone = pickle.loads(pickle.dumps(store))
    assert clone.hot is not None and clone.hot._backend is None  # reopened where it lands
    assert [t.url for t in clone.tiers] == [t.url for t in store.tiers]
    secret = Store("s3://AKIAEXAMPLE:hunter2@bucket/run")
    assert "hunter2" not in repr(secret) and "hunter2" not in secret.label


def test_writer_and_reader_built_from_a_store_pickle(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "hot"))
    dcp.save(state_for(1), storage_writer=TieredWriter(store, step=1))
    reader = pickle.loads(pickle.dumps(TieredReader(store, options=ReaderOptions(thread_count=2))))
    state = blank()
    dcp.load(state, storage_reader=reader)
    assert matches(state, 1)
