"""The copies machine (actors_copies.py) catches the copies' bug classes when they are put
back, each by wrapping one function of the product in the forked actors (they inherit the
patch), never by copying product code:

* a copy kept without its CRC32C checked (``FileSink.close`` taking whatever arrived for the
  manifest's bytes): with a disk error flipping a bit of a file a round or a restore then
  reads to send, the receiver keeps the damaged bytes and its record vouches for them:
  invariant 1 (trusted is complete) must find a copy the product wrote that does not verify;
* a round that publishes though a transfer failed (``protect._record`` told every copy
  verified): with a disk error on a sender, the receiver refuses the file, yet the record
  says it holds it: invariant 1 must find it missing;
* a prune that takes a checkpoint protected by copies for one the cold tier committed (its
  ``prune_node_local`` given a cold listing that also names the replica namespace's
  manifests): it deletes the files and copies of a checkpoint cold never got on every node it
  prunes: invariant 3 must find the last verified copy gone.

Each catch runs a machine of the actors it needs only (the rules it does not want set to
``None``), so its budget is its own; ``test_copies_machine.py`` runs them all together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import actors_copies
import pytest
import test_suite_catches_bugs as catches
from actors_copies import CopiesMachine
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from tierstore.format.manifest import Manifest
from tierstore.lifecycle import prune as prune_mod
from tierstore.redundancy import protect as protect_mod
from tierstore.redundancy import records


class DiskErrorsAndRounds(CopiesMachine):
    """Saves (mostly with their round), disk errors, rounds, lost nodes and restores."""

    protect_held = restore_held = prune_held = save_held = migrate_held = gc_held = None  # type: ignore[assignment]


class RoundsAfterDiskErrors(DiskErrorsAndRounds):
    """Saves, disk errors and rounds, each save's round a step of its own (a disk error may
    come in between), no node lost."""

    lose_a_node = restore_alone = None  # type: ignore[assignment]

    @rule(data=st.data(), migrate=st.booleans())
    def save_alone(self, data: st.DataObject, migrate: bool) -> None:
        step, self.next_step = self.next_step, self.next_step + 1
        self.run_alone(self._save(step, migrate, protects=False))


class PrunesOfUnmigrated(CopiesMachine):
    """Saves (half of them never migrated), rounds and prunes of one node or both."""

    protect_held = restore_held = prune_held = save_held = migrate_held = gc_held = None  # type: ignore[assignment]
    a_disk_flips_a_bit = lose_a_node = restore_alone = None  # type: ignore[assignment]

    @rule(data=st.data())
    def prune_alone(self, data: st.DataObject) -> None:
        self.run_alone(self.plan("prune", data))


def keeping_unchecked(close: Callable[[records.FileSink], None]) -> Callable[[records.FileSink], None]:
    """``FileSink.close`` that takes the bytes that arrived for the manifest's (sizes still
    checked): a copy damaged on its way, or read from a damaged disk, is kept."""

    def buggy(sink: records.FileSink) -> None:
        sink._crc = sink.crc  # BUG: the CRC32C of what arrived is never compared
        close(sink)

    return buggy


def claiming_every_copy(record: Callable[..., Any]) -> Callable[..., Any]:
    """``protect._record`` told that every copy of the round verified: a round publishes its
    checkpoint though a transfer failed."""

    def buggy(scheme: Any, topology: Any, manifest: Manifest, reports: list[Any]) -> Any:
        for report in reports:  # BUG: what was sent, not what verified
            report.verified = dict.fromkeys(range(topology.world), True)
            report.metadata_ok = True
        return record(scheme, topology, manifest, reports)

    return buggy


def believing_copies(prune_node_local: Callable[..., Any]) -> Callable[..., Any]:
    """``prune_node_local`` whose cold listing also names what the node's copies protect: a
    checkpoint protected on other nodes is taken for one the cold tier committed."""

    def buggy(hot: Any, cold: Any, policy: Any, *, peers: Any = None, **options: Any) -> Any:
        class Catalog:
            def manifests(self) -> list[Manifest]:
                committed = {m.name: m for m in cold.manifests()}
                for manifest in peers.manifests() if peers is not None else []:
                    committed.setdefault(manifest.name, manifest)  # BUG: protected is not committed
                return list(committed.values())

        return prune_node_local(hot, Catalog(), policy, peers=peers, **options)

    return buggy


def test_the_catch_machines_keep_every_invariant() -> None:
    for machine in (DiskErrorsAndRounds, RoundsAfterDiskErrors, PrunesOfUnmigrated):
        run_state_machine_as_test(machine, settings=catches.generated(2, 6))


def test_the_machine_catches_a_copy_kept_without_its_crc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records.FileSink, "close", keeping_unchecked(records.FileSink.close))
    catches.expect_caught(DiskErrorsAndRounds, "publishes .*damaged:", catches.generated(60, 10))


def test_the_machine_catches_a_round_publishing_a_failed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protect_mod, "_record", claiming_every_copy(protect_mod._record))
    catches.expect_caught(RoundsAfterDiskErrors, "publishes .*missing:", catches.generated(60, 10))


def test_the_machine_catches_a_prune_of_what_cold_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prune_mod, "prune_node_local", believing_copies(prune_mod.prune_node_local))
    assert actors_copies.prune_mod is prune_mod  # the actors call it through the module
    catches.expect_caught(PrunesOfUnmigrated, "last verified copy", catches.generated(60, 10))
