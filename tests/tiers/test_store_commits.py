"""What a store says about its commits: which tiers commit a whole checkpoint (node-local hot
tiers do not), which hold an attempt now, and the one way to find a manifest in a tier."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format import layout
from tierstore.format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from tierstore.tiers.tier import Store, Tier


def manifest(step: int, attempt: str) -> Manifest:
    files = [FileEntry(".metadata", 4, 1, 0), FileEntry("__0_0.distcp", 8, 2, 0)]
    return Manifest(layout.default_name(step), step, attempt, 1, float(step), files)


def test_node_local_lives_on_the_store_and_only_cold_commits_then(tmp_path: Path) -> None:
    store = Store(tmp_path / "hot", tmp_path / "cold")
    assert not store.node_local and store.committed_tiers == store.tiers
    local = Store.of(store, node_local=True)
    assert local.node_local and local.committed_tiers == [store.cold]
    assert local.hot is store.hot and local.cold is store.cold  # the same tiers, shared
    assert Store.of(store) is store and Store.of(local) is local
    assert "node_local=True" in repr(local)
    with pytest.raises(ConfigError, match="needs both a hot and a cold tier"):
        Store(tmp_path / "hot", node_local=True)
    with pytest.raises(ConfigError, match="True or False"):
        Store(tmp_path / "hot", tmp_path / "cold", node_local="yes")  # type: ignore[arg-type]


def test_the_constructors_take_node_local_from_a_store_given_them(tmp_path: Path) -> None:
    from tierstore import CheckpointManager, StagingOptions, TieredReader, TieredWriter

    local = Store(tmp_path / "hot", tmp_path / "cold", node_local=True)
    shared = Store(tmp_path / "hot", tmp_path / "cold")
    writer = TieredWriter(local, step=1)
    assert writer.node_local and writer.store is local  # a node-local store stays node-local
    assert TieredReader(local).node_local and not TieredReader(shared).node_local
    assert TieredReader(Store.of(shared, node_local=True)).node_local  # Store.of says it for this reader
    assert not TieredWriter(Store.of(local, node_local=False), step=1).node_local
    with CheckpointManager(local, staging=StagingOptions(async_save=False)) as manager:
        assert manager.node_local and manager.catalog.tiers == [local.cold]
    with CheckpointManager(shared, staging=StagingOptions(async_save=False)) as manager:
        assert not manager.node_local and manager.catalog is shared
    for build in (
        lambda: TieredWriter(Store.of(str(tmp_path / "hot"), node_local=True), step=1),
        lambda: CheckpointManager(Store(str(tmp_path / "hot"), node_local=True)),
        lambda: TieredReader(Store.of(str(tmp_path / "hot"), node_local=True)),
    ):
        with pytest.raises(ConfigError, match="needs both a hot and a cold tier"):
            build()


def test_holders_are_the_tiers_holding_that_attempt_now(tmp_path: Path) -> None:
    store = Store(tmp_path / "hot", tmp_path / "cold")
    assert store.hot is not None and store.cold is not None
    first = manifest(3, "20261201T000000Z-00000001")
    store.hot.publish_manifest(first)
    store.cold.publish_manifest(first)
    assert store.holders(first) == [store.hot, store.cold]
    assert store.holders(first, among=[store.cold]) == [store.cold]
    assert store.hot.unpublish(first)
    again = manifest(3, "20261201T000000Z-00000002")  # the name committed again, another attempt
    store.hot.publish_manifest(again)
    assert store.holders(first) == [store.cold]
    assert store.holders(again) == [store.hot]


def test_an_oversized_manifest_is_invalid_naming_key_and_tier() -> None:
    tier = Tier("cold", f"memory://oversized-{uuid.uuid4().hex}")
    key = layout.manifest_key("step-0000000001")
    tier.backend.publish(key, b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(InvalidManifest) as caught:
        tier.find_manifest("step-0000000001")
    assert caught.value.key == key and caught.value.tier == tier.label
    assert "larger than" in str(caught.value) or "byte limit" in str(caught.value)


def test_the_store_id_is_a_real_attribute_set_once_read(tmp_path: Path) -> None:
    from tierstore.tiers import marks

    tier = Tier("cold", tmp_path / "cold")
    assert tier.store_id is None  # not read yet
    found = marks.store_id(tier, create=True)
    assert found is not None and tier.store_id == found
