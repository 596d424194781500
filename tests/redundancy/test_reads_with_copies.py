"""Loads of a checkpoint protected by copies on other nodes (issue 37), in one process with
real files: a node-local store's checkpoint, committed in cold, whose files this node's
replica namespace (``hot/replicas``) also holds, as a protection round leaves them.

A checkpoint protected there is read from hot, then from the copies, then from cold, every
byte verified against the manifest: a damaged, planted or stale copy is never what a load
returns. Pruning a checkpoint takes its copies with it, and nothing else. The collectives
that make the copies are tested with real jobs in tests/redundancy/test_copies_dist.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import DATA_FILE, blank, flip, matches, state_for, unwrap

from tierstore import ReaderOptions, Store, TieredReader, TieredWriter
from tierstore.errors import CheckpointNotFound, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.prune import prune_node_local
from tierstore.lifecycle.retention import keep_last
from tierstore.redundancy import Replicas, Topology
from tierstore.redundancy.records import Record, peer_tier, record_key, write_record

META = layout.METADATA_FILE


class Node:
    """A node-local store in ``root`` (``hot``, ``cold``) and its replica namespace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hot, self.cold = str(root / "hot"), str(root / "cold")
        self.store = Store(self.hot, self.cold, node_local=True)
        assert self.store.hot is not None and self.store.cold is not None
        self.hot_tier, self.cold_tier = self.store.hot, self.store.cold
        self.peers = peer_tier(self.hot_tier)

    def save(self, step: int, content: int | None = None) -> Manifest:
        """Save ``state_for(content)`` (default: ``step``) as ``step``, committed in cold."""
        writer = TieredWriter(self.store, step=step)
        dcp.save(state_for(step if content is None else content), storage_writer=writer)
        assert writer.migrator is not None and writer.migrator.wait(30)  # committed in cold
        manifest = writer.manifest
        assert manifest is not None
        cold = self.cold_tier.find_manifest(manifest.name)
        assert cold is not None and cold.attempt == manifest.attempt
        return manifest

    def hot_file(self, manifest: Manifest, path: str = DATA_FILE) -> Path:
        return Path(self.hot, layout.file_key(manifest.name, manifest.attempt, path))

    def copy_of(self, manifest: Manifest, path: str = DATA_FILE) -> Path:
        return Path(self.peers.url, self.peers.file_key(manifest.name, manifest.attempt, path))

    def protect(self, manifest: Manifest, source: Node | None = None) -> list[Path]:
        """Hold ``manifest``'s files (from ``source``'s hot root, default this node's) in the
        replica namespace, with its record, then publish it there: what a protection round
        that verified every copy leaves on a node."""
        source = source or self
        copies = []
        for entry in manifest.files:
            copy = self.copy_of(manifest, entry.path)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source.hot_file(manifest, entry.path), copy)
            copies.append(copy)
        write_record(
            self.peers, Record(manifest.name, manifest.attempt, Replicas(2), Topology(2, 1), {0: [0, 1]}, {})
        )
        self.peers.publish_manifest(manifest)
        return copies

    def drop_hot_files(self, manifest: Manifest, paths: tuple[str, ...] = (META, DATA_FILE)) -> None:
        for path in paths:
            self.hot_file(manifest, path).unlink()

    def load(self, name: str, *, peers: bool = True) -> tuple[dict[str, Any], TieredReader]:
        store = self.store.with_peers(self.peers) if peers else self.store
        target = blank()
        reader = TieredReader(store, name=name, options=ReaderOptions(lease=False))
        dcp.load(target, storage_reader=reader)
        return target, reader

    def cold_away(self) -> None:
        """The cold tier is gone (a bucket down, a mount lost): its directory moved aside."""
        Path(self.cold).rename(self.root / "cold.away")


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path / "node")


@pytest.fixture
def protected(node: Node) -> Manifest:
    """Step 1 committed in cold and protected on this node, its hot files deleted: this
    node's disk was replaced, and its files came back only as the copies."""
    manifest = node.save(1)
    node.protect(manifest)
    node.drop_hot_files(manifest)
    return manifest


# -- a. the copies serve a load ----------------------------------------------------------------


def test_a_protected_checkpoint_loads_from_the_copies(node: Node, protected: Manifest) -> None:
    state, reader = node.load(protected.name)
    assert matches(state, 1)
    assert reader.manifest is not None and reader.manifest.attempt == protected.attempt
    assert reader.sources == {META: "peer", DATA_FILE: "peer"}
    assert set(reader.bytes_read) == {node.peers.label}  # not a byte from cold
    # Without the copies the same load goes to cold: they are what served it above.
    state, reader = node.load(protected.name, peers=False)
    assert matches(state, 1) and reader.sources == {META: "cold", DATA_FILE: "cold"}


def test_a_protected_checkpoint_loads_with_the_cold_tier_gone(node: Node, protected: Manifest) -> None:
    node.cold_away()
    state, reader = node.load(protected.name)
    assert matches(state, 1)
    assert reader.sources == {META: "peer", DATA_FILE: "peer"}
    # Control: the same load without the copies has nothing to read it from.
    with pytest.raises(BaseException) as info:
        node.load(protected.name, peers=False)
    assert isinstance(unwrap(info.value), CheckpointNotFound)


def test_the_nodes_own_file_comes_first_then_the_copy(node: Node) -> None:
    manifest = node.save(1)
    node.protect(manifest)
    node.drop_hot_files(manifest, (META,))  # the data file still on this node's disk
    state, reader = node.load(manifest.name)
    assert matches(state, 1)
    assert reader.sources == {META: "peer", DATA_FILE: "hot"}


# -- b. a damaged copy -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [DATA_FILE, META])
def test_a_damaged_copy_is_refused_and_the_file_read_from_cold(
    node: Node, protected: Manifest, path: str
) -> None:
    flip(node.copy_of(protected, path))
    state, reader = node.load(protected.name)
    assert matches(state, 1)  # bit-exact: never the damaged bytes
    assert reader.sources[path] == "cold"
    other = DATA_FILE if path == META else META
    assert reader.sources[other] == "peer"


def test_a_damaged_copy_with_no_cold_tier_fails_the_load_rather_than_load_it(
    node: Node, protected: Manifest, caplog: pytest.LogCaptureFixture
) -> None:
    flip(node.copy_of(protected))
    node.cold_away()
    with caplog.at_level(logging.WARNING, logger="tierstore"), pytest.raises(BaseException) as info:
        node.load(protected.name)
    # The load fails (the last tier tried, cold, lacks the file) rather than return the
    # damaged bytes; the copy was refused for its CRC32C, not skipped as missing.
    assert isinstance(unwrap(info.value), TierstoreError), unwrap(info.value)
    refused = [r.getMessage() for r in caplog.records if "CRC32C mismatch" in r.getMessage()]
    assert refused and all(node.peers.label in m and DATA_FILE in m for m in refused)


# -- c. a planted copy ------------------------------------------------------------------------


def test_a_planted_copy_of_the_same_size_is_refused(tmp_path: Path, node: Node, protected: Manifest) -> None:
    # Another valid file of exactly the same size: step 2's shard of another run, put where
    # this node keeps step 1's copy. A check of sizes (or of "some valid shard") passes it.
    elsewhere = Node(tmp_path / "elsewhere")
    planted = elsewhere.hot_file(elsewhere.save(2))
    copy = node.copy_of(protected)
    assert planted.stat().st_size == copy.stat().st_size and planted.read_bytes() != copy.read_bytes()
    shutil.copyfile(planted, copy)
    state, reader = node.load(protected.name)
    assert matches(state, 1) and not matches(state, 2)
    assert reader.sources == {META: "peer", DATA_FILE: "cold"}


# -- d. a stale attempt of the name ------------------------------------------------------------


@pytest.fixture
def stale(tmp_path: Path, node: Node) -> tuple[Manifest, Manifest]:
    """``(stale, current)``: this node protects attempt A of step 1 (holding step 7's values),
    while cold has since committed attempt B of the same name (step 1's values); B is not
    protected yet (its round is still to run, or failed)."""
    elsewhere = Node(tmp_path / "elsewhere")
    old = elsewhere.save(1, content=7)
    current = node.save(1)
    assert old.name == current.name and old.attempt != current.attempt
    node.protect(old, source=elsewhere)
    return old, current


def test_the_reader_told_the_current_attempt_never_takes_the_stale_copy(
    node: Node, stale: tuple[Manifest, Manifest]
) -> None:
    old, current = stale
    reader = TieredReader(node.store.with_peers(node.peers), name=current.name)
    assert reader._protected(current.name, current.attempt) is None
    found = reader._protected(old.name, old.attempt)
    assert found is not None and found.attempt == old.attempt
    # What every rank but the coordinator does with the (name, attempt) it was sent.
    manifest, holders = reader._follow(current.name, current.attempt)
    assert manifest.attempt == current.attempt
    assert node.peers not in holders and [t.role for t in holders] == ["cold"]


def test_a_load_by_name_does_not_take_a_stale_attempt_of_the_copies(
    node: Node, stale: tuple[Manifest, Manifest]
) -> None:
    old, current = stale
    state, reader = node.load(current.name)
    assert not matches(state, 7), "loaded the stale attempt's values from the copies"
    assert matches(state, 1)
    assert reader.manifest is not None and reader.manifest.attempt == current.attempt
    assert "peer" not in reader.sources.values()


# -- e. pruning takes a checkpoint's copies with it ------------------------------------------------


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("own_files", [True, False], ids=["own-files-too", "copies-only"])
def test_prune_node_local_drops_the_pruned_checkpoints_copies_only(
    tmp_path: Path, node: Node, own_files: bool
) -> None:
    first, second = node.save(1), node.save(2)
    first_copies, second_copies = node.protect(first), node.protect(second)
    # Protected on this node but never committed in cold (another run's, or its cold
    # commit not made yet): not this prune's to touch, and older than anything kept.
    elsewhere = Node(tmp_path / "elsewhere")
    uncommitted = elsewhere.save(0)
    uncommitted_copies = node.protect(uncommitted, source=elsewhere)
    if not own_files:  # a node that holds only copies of step 1 (its files are other ranks')
        node.drop_hot_files(first)
        assert node.hot_tier.unpublish(first)
    size = sum(e.size for e in first.files)

    dry = prune_node_local(node.hot_tier, node.cold_tier, keep_last(1), dry_run=True, peers=node.peers)
    assert dry.deleted == (first.name,) and all(p.exists() for p in first_copies)

    report = prune_node_local(node.hot_tier, node.cold_tier, keep_last(1), peers=node.peers)
    assert report.deleted == (first.name,) and not report.errors
    assert report.bytes_freed == (2 if own_files else 1) * size  # its own files and the copies
    # Step 1's protection is gone: manifest, copies, record.
    assert node.peers.find_manifest(first.name) is None
    assert not any(p.exists() for p in first_copies)
    assert not Path(node.peers.url, record_key(first.name, first.attempt)).exists()
    assert not node.hot_file(first).exists()
    # Step 2's stays whole, and still serves a load on its own.
    here = node.peers.find_manifest(second.name)
    assert here is not None and here.attempt == second.attempt
    assert all(p.exists() for p in second_copies)
    assert Path(node.peers.url, record_key(second.name, second.attempt)).exists()
    # The checkpoint never committed in cold: untouched.
    kept = node.peers.find_manifest(uncommitted.name)
    assert kept is not None and kept.attempt == uncommitted.attempt
    assert all(p.exists() for p in uncommitted_copies)
    assert Path(node.peers.url, record_key(uncommitted.name, uncommitted.attempt)).exists()
    # Nothing under the replica namespace but what the two kept protections hold.
    left = _files(Path(node.peers.url))
    assert not any(first.attempt in str(p) for p in left)

    node.drop_hot_files(second)
    node.cold_away()
    state, reader = node.load(second.name)
    assert matches(state, 2) and set(reader.sources.values()) == {"peer"}
