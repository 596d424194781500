"""The copies machine (actors_copies.py): two nodes of one rank each, ``Replicas(2)``, saves,
protect rounds, migrations, prunes, GC, lost nodes, disk errors and restores, interleaved at
every gate between a check and its act, with the copies' invariants after every step.

Sized by the suite's profiles: under ``ci`` (``make test``) a few derandomized examples
(``TIERSTORE_CRASH_EXAMPLES`` / ``TIERSTORE_CRASH_STEPS`` override them); under ``soak`` a
quarter of the soak profile's examples, fresh ones every run.

The machine found product bugs; each is replayed below, step by step through the machine's
own actors and invariants: those fixed as plain tests (the machine runs them too), the others
as ``xfail(strict=True)`` tests (the machine steers around them,
``actors_copies.ROUND_AND_PRUNE``, so that it goes on looking for others)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from actors_copies import CopiesMachine
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from multi_actor import PROFILE

from tierstore.format import layout
from tierstore.redundancy.records import read_record

CI_EXAMPLES, CI_STEPS = 16, 12


def copies_settings() -> settings:
    base = settings.get_profile(PROFILE)
    if PROFILE == "ci":
        return settings(
            base,
            max_examples=int(os.environ.get("TIERSTORE_CRASH_EXAMPLES", CI_EXAMPLES)),
            stateful_step_count=int(os.environ.get("TIERSTORE_CRASH_STEPS", CI_STEPS)),
        )
    return settings(base, max_examples=max(1, base.max_examples // 4))  # soak: 500


def test_copies_machine() -> None:
    run_state_machine_as_test(CopiesMachine, settings=copies_settings())


# -- the product bugs it found, replayed -------------------------------------------------------


class Draws:
    """What hypothesis would have drawn, by label (a replay draws nothing at random)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = {label.replace("_", " "): value for label, value in answers.items()}

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        return self.answers[label]


@pytest.fixture
def machine() -> Iterator[CopiesMachine]:
    """The machine, not steering around the bugs, driven step by step."""
    driven = CopiesMachine()
    driven.steer = False
    try:
        yield driven
    finally:
        driven.teardown()


def invariants(machine: CopiesMachine) -> None:
    machine.copies_invariants()


def saved(machine: CopiesMachine, *steps: tuple[bool, bool]) -> list[str]:
    """Two-rank saves, each ``(migrated to cold, its round run)``; every invariant held after
    each (a setup that breaks one is not the bug under test: RuntimeError, not xfail's)."""
    names = []
    for migrate, protects in steps:
        step, machine.next_step = machine.next_step, machine.next_step + 1
        machine.run_alone(machine._save(step, migrate, protects))
        names.append(layout.default_name(step))
        try:
            invariants(machine)
        except AssertionError as err:
            raise RuntimeError(f"the setup broke an invariant: {err}") from err
    return names


# Found by the machine: prune_node_local deleted a node's own files before drop_copies
# un-published the checkpoint's manifest in its replica namespace; killed in between, the node
# published a protection whose record named them. Fixed: the protection goes first.
@pytest.mark.parametrize("point", ["prune.after_file_delete", "peers.before_drop_unpublish"])
def test_a_prune_killed_between_its_deletes_leaves_a_protection_naming_them(
    machine: CopiesMachine, point: str
) -> None:
    saved(machine, (True, True), (True, True))  # step 1 and step 2 committed in cold, protected
    # Node 1's prune drops step 1 (keep_last(1)) and is killed after deleting its own files.
    machine.force(Draws(prune_nodes=(1,), gc_node=0), "prune", point, "gc", "kill")
    invariants(machine)  # node 1 publishes step 1, its record says node 1 holds rank 1's files


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a protect round and a prune of one checkpoint are not arbitrated: a round that "
    "publishes after the prune deleted the checkpoint's files on a node (no look before "
    "Peers._publish_here), or a prune that decided before the round published (its 'copied' "
    "view is stale: drop_copies is not called), leaves a node publishing a protection whose "
    "files are gone",
)
@pytest.mark.parametrize(
    ("a", "point", "b"),
    [
        ("protect", "peers.before_publish", "prune"),  # the round is slow; the prune drops its checkpoint
        ("protect", "peers.after_transfer", "prune"),
        ("prune", "prune.before_unpublish", "protect"),  # the round comes while the prune acts
    ],
)
def test_a_round_and_a_prune_of_one_checkpoint(machine: CopiesMachine, a: str, point: str, b: str) -> None:
    # The manager's round of step 1 runs late: step 2 is saved, committed in cold and
    # protected, and the prune after it drops step 1 (committed in cold, not the newest).
    first, _ = saved(machine, (True, False), (True, True))
    machine.force(Draws(prune_nodes=(0,)), a, point, b, "release", target=first)
    invariants(machine)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a restore and a prune of one checkpoint are not arbitrated: the restore publishes "
    "node 0's hot manifest again (Peers._restore_one: 'find_manifest is None' taken for lost "
    "with the node) for a checkpoint the prune un-published and whose files it deletes",
)
@pytest.mark.parametrize(
    ("a", "point", "b", "lose"),
    [
        ("prune", "prune.after_unpublish", "restore", None),  # a relaunch while a prune acts
        ("restore", "peers.before_restore_transfer", "prune", 1),  # `tierstore prune` during a relaunch
    ],
)
def test_a_restore_and_a_prune_of_one_checkpoint(
    machine: CopiesMachine, a: str, point: str, b: str, lose: int | None
) -> None:
    saved(machine, (True, True), (True, False))  # step 1 protected, step 2 newer in cold
    if lose is not None:
        machine.lose_a_node(lose)
    machine.force(Draws(prune_nodes=(0,), lose_first=False), a, point, b, "release")
    invariants(machine)  # node 0's hot tier commits step 1, its files deleted


# Found by the machine: collect_garbage deleted what its scan found without a second look at
# the replica namespace: held after its scan while a restore (or a round) published an attempt
# whose files the scan found unpublished on that node, it deleted a protection published since.
# Fixed: a second look at the namespace just before deleting (gc._still_unpublished).
@pytest.mark.parametrize("b", ["restore", "protect"])
def test_gc_held_after_its_scan_while_the_attempt_is_published(machine: CopiesMachine, b: str) -> None:
    (first,) = saved(machine, (False, False))
    # Step 1's round: rank 1's node is lost between the transfers and its publish (its rank
    # killed at peers.before_publish, rank 0 released): node 0 publishes, node 1 holds its
    # files and its copies unpublished.
    machine.force(
        Draws(gc_node=0, the_rank_killed=1),
        "protect",
        "peers.before_publish",
        "gc",
        "kill-rank",
        target=first,
    )
    try:
        invariants(machine)
    except AssertionError as err:
        raise RuntimeError(f"the setup broke an invariant: {err}") from err
    # GC of node 1 (its grace 0) scans, then the relaunch's restore (or a round) publishes step 1
    # on node 1 from what it holds; GC deletes what it scanned.
    machine.force(Draws(gc_node=1), "gc", "gc.after_scan", b, "release", target=first)
    invariants(machine)  # node 1 publishes step 1, its files gone


def test_a_restore_never_counts_a_node_without_the_checkpoints_metadata(machine: CopiesMachine) -> None:
    # Two faults (a disk error in node 1's copy of .metadata, node 0 lost): the restore cannot
    # bring .metadata back to node 0, so its record must not count node 0 as holding the
    # coordinator's rank (it did: protect._record_from_inventory counted data files only).
    (first,) = saved(machine, (True, True))  # step 1 protected on both nodes
    key = next(iter(machine.published(1)))
    manifest = machine.required[key]
    meta = manifest.file(manifest.metadata_file)
    assert meta is not None
    copy = machine.path(1, "peer", key, meta.path)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 1  # a disk error in node 1's copy of .metadata
    copy.write_bytes(bytes(data))
    machine.lose_a_node(0)  # node 0, which wrote .metadata, lost
    machine.run_alone(machine.plan("restore", Draws()))
    record = read_record(machine.peers(0), manifest)
    assert record is not None
    holds_meta = machine.verified(0, "hot", key, meta)
    assert holds_meta or 0 not in record.holders[meta.rank], (
        f"node 0 publishes {first} holding rank {meta.rank} ({record.holders}) without its .metadata"
    )
