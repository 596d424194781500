"""The suite catches the quarantine bugs of issue 34 (item 3) when they are put back, each
by wrapping or replacing one helper of the product, never by copying product code:

* a resume's quarantine that takes a failure's word for damage (no proof in the tier): the
  multi-actor machine, asking its quarantine actor to set aside good copies, must find a
  checkpoint that vanished (or a record of a good copy);
* ``tierstore quarantine --delete`` deleting the data of the attempt committed now (a
  record planted for it, or left by an interrupted ``--restore``): the machine must find a
  published manifest naming missing files;
* ``--restore`` refusing to finish a restore interrupted between its publish and its record
  delete: the machine must find the refusal;
* a resume that takes one 404 for a missing file (one read, no listing): the lifecycle
  scenario of a transient 404 on the cold tier must find the job rolled back.

The machine here is :class:`multi_actor.Machine` with only saves and the quarantine actors
(actors_quarantine.py), so their budget is theirs; ``test_multi_actor.MultiActor`` runs them
among every other actor.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import forking
import pytest
import test_suite_catches_bugs as catches
from actors_quarantine import QuarantineActors
from cold_tiers import Cold
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test
from multi_actor import Machine

from tierstore.dcp import fallback
from tierstore.lifecycle import quarantine as quarantine_mod

# The scenario test and its fixture (a local tier answering 404s), from tests/lifecycle.
sys.path.insert(0, str(Path(__file__).parents[1] / "lifecycle"))
import test_quarantine_proof as scenario

answers404 = scenario.answers404


class QuarantineMachine(QuarantineActors, Machine):
    """Saves (half of them migrated), and the quarantine actors' rules."""

    worlds = (1,)

    interleave = two_migrators_of_one_checkpoint = damage_an_upload_mark = None  # type: ignore[assignment]
    replace_an_uploaded_object = migrate_once_the_faults_stop = None  # type: ignore[assignment]

    @rule(data=st.data())
    def save_migrated(self, data: st.DataObject) -> None:
        step = self.actor("save", data, migrate=True)
        self.check(step, forking.run(step.fn, world=step.world), faulted=False)


def test_the_quarantine_actors_keep_every_invariant() -> None:
    QuarantineMachine.s3 = None
    run_state_machine_as_test(QuarantineMachine, settings=catches.generated(12, 8, quiet=True))


def test_the_machine_catches_a_quarantine_without_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old resume: whatever a load raised was damage, in every tier holding the attempt.
    monkeypatch.setattr(quarantine_mod, "prove_damage", lambda tier, manifest, failures: failures[0])
    catches.expect_caught(QuarantineMachine, "vanished|a good copy", catches.generated(20, 6, quiet=True))


def test_the_machine_catches_a_delete_of_the_committed_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old delete: a record's data went, whatever the tier had published since.
    monkeypatch.setattr(quarantine_mod, "_refuse_if_live", lambda tier, record: None)
    catches.expect_caught(
        QuarantineMachine, "names missing or damaged|delete took files", catches.generated(20, 6, quiet=True)
    )


def test_the_machine_catches_a_restore_that_will_not_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old restore: publish, and a name committed already (by this very attempt) refused.
    monkeypatch.setattr(quarantine_mod, "_is_live", lambda tier, manifest: False)
    catches.expect_caught(
        QuarantineMachine, "refused to finish|did not finish", catches.generated(20, 6, quiet=True)
    )


def reading_once(
    manifest: Any, holders: Any, entry: Any, consume: Any, *, node_local: bool, served: Any
) -> None:
    """``fallback.read_nearest`` as it was: the last tier's first error is the verdict."""
    failed = fallback._each_holder(manifest, holders, entry, consume, node_local, served, proving=False)
    if failed is not None:
        raise failed[-1]


def test_the_transient_404_scenario_catches_a_resume_that_reads_once(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    monkeypatch.setattr(fallback, "read_nearest", reading_once)
    cold = Cold("local", str(tmp_path / "cold"), {}, {})
    with pytest.raises(AssertionError, match="rolled back a step"):
        scenario.test_a_transient_404_from_the_cold_tier_neither_quarantines_nor_rolls_back(
            cold, request, tmp_path
        )
