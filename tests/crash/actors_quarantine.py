"""Quarantine as actors of the multi-actor machine (multi_actor.py): a resume's quarantine
(prove, record, un-publish), and a person's ``tierstore quarantine --restore`` and
``--delete``, each held between its check and its act (docs/design.md invariant 19) at
``quarantine.after_check`` / ``quarantine.after_record``, ``quarantine.restore_after_check``
/ ``quarantine.restore_after_publish`` and ``quarantine.delete_after_check`` while another
actor runs.

The machine damages nothing by itself, so a quarantine is of one of two kinds:

* of a good copy (what a resume that took one transient 404, or one flaky read, for damage
  would ask): it must be refused, and the checkpoint must not vanish (no excuse is made);
* of a copy damaged on purpose: one hot file of a checkpoint committed in cold is moved
  aside just before, so the copy is provably missing it; the hot copy may then vanish by
  quarantine, and the file is put back once the actor ends (the damage was a tier that was
  briefly wrong), so what the record names is whole again and a restore is sound.

A rule also plants a quarantine record for a committed attempt: what a ``--restore``
interrupted between its publish and its record delete leaves (and what someone may plant).
``--delete`` must then delete nothing; ``--restore`` must finish.

What each actor promises, checked right after it (``check_<kind>``) on top of the machine's
invariants:

* a refused quarantine wrote no record and un-published nothing;
* a delete never deletes a byte of an attempt committed in that tier (checked at once,
  while the other actor is still held, since a later un-publish would hide it);
* a restore killed anywhere is finished by the next ``--restore``;
* what a quarantine set aside stays whole until a person deletes or restores it.

A hot prune is also held after its listing (and at each later gate) while a resume
quarantines a checkpoint it decided on: it must leave the quarantined data.

Operator against operator (``--restore`` and ``--delete`` of one checkpoint at once) is
not arbitrated by the store (no lock spans two keys) and is not paired here.

A machine derived from the suite's for one purpose (a catch of test_suite_catches_bugs.py)
has none of these rules unless it sets ``quarantine_actors = True``: even turned off by a
precondition they would move its derandomized search (a catch of a cold commit checking sizes
only missed its budget); the invariants run in every machine.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forking
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from multi_actor import POINTS, WIRE, Step
from stats import STATS

from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    IntegrityError,
    ObjectNotFound,
    PublishConflict,
)
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.quarantine import (
    delete_quarantined,
    list_quarantined,
    quarantine_proven,
    restore_quarantined,
)
from tierstore.migration.transfer import has_verified_copy
from tierstore.tiers.tier import Store as TierStore
from tierstore.tiers.tier import Tier

__all__ = ["QuarantineActors", "QStep", "QUARANTINE", "RESTORE", "DELETE"]

QUARANTINE = ("quarantine.after_check", "quarantine.after_record")
RESTORE = ("quarantine.restore_after_check", "quarantine.restore_after_publish")
DELETE = ("quarantine.delete_after_check",)
# What may run while one of ours is held: the machine's own actors and a resume's quarantine.
BESIDE = ("save", "saves", "migrate", "prune", "prune-hot", "prune-cold", "load", "gc")
# What a person's command may fail with, clearly, losing nothing: the record went meanwhile,
# its data is no longer whole (restore: a prune decided on it before it was quarantined).
# A refusal of a live attempt (CheckpointExists) is returned by the actor with what it saw.
REFUSALS = {None, "CheckpointNotFound", "IntegrityError"}
SURFACED = {None, "TransientStorageError", "StorageError"}
# The rules below: a machine derived for one purpose runs them only if it opts in.
RULES = (
    "plant_a_record_for_a_live_attempt",
    "a_person_acts_on_a_record_of_a_live_attempt",
    "quarantine_held",
    "quarantine_command_held",
    "load_or_gc_held_while_quarantine_acts",
    "prune_held_while_a_resume_quarantines",
)


@dataclass
class QStep(Step):
    """One of our actors, with what it targets: ``(role, name, attempt)``."""

    target: tuple[str, str, str] | None = None
    aside: str | None = None  # the hot file moved aside (a copy damaged on purpose)
    had_record: bool = False


class QuarantineActors:
    """Actors ``quarantine``, ``q-restore`` and ``q-delete`` (module docstring), mixed into
    :class:`test_multi_actor.MultiActor` over :class:`multi_actor.Machine`."""

    store: Any
    root: Path
    may_vanish: dict[str, set[str]]
    # Machine's: the checker's direct, fault-free tiers; planning, running and checking actors.
    tier: Any
    actor: Any
    check: Any
    force: Any
    quarantine_actors = True  # the rules below run (module docstring)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        derived = any(
            QuarantineActors in base.__mro__ and base is not QuarantineActors for base in cls.__bases__
        )
        if derived and "quarantine_actors" not in cls.__dict__:
            cls.quarantine_actors = False  # a machine for one purpose: it opts in
        if not cls.quarantine_actors:
            # Gone, not merely off: a rule a precondition turns off still takes its share of
            # the draws, and moved a derandomized catch's search until it missed.
            for name in RULES:
                if name not in cls.__dict__:
                    setattr(cls, name, None)

    def __init__(self) -> None:
        super().__init__()
        # (name, attempt, file) of hot files moved aside -> (where they belong, where they are)
        self.q_aside: dict[tuple[str, str, str], tuple[Path, Path]] = {}
        self.q_kept: set[tuple[str, str]] = set()  # quarantined by us, whole: kept until a person acts
        self.q_deleting: set[tuple[str, str]] = set()  # a delete ran on it (its data may go)
        self.q_broken: list[str] = []  # promises our actors broke this step
        self.q_planted: tuple[str, str, str] | None = None  # the next person's target

    # -- helpers -------------------------------------------------------------------------

    def _q_records(self) -> list[tuple[str, Any]]:
        found = []
        for role in ("hot", "cold"):
            for q in list_quarantined(TierStore.of_tiers(self.tier(role), None)):
                found.append((role, q))
        return sorted(found, key=lambda x: (x[0], x[1].name, x[1].attempt))

    def _q_record(self, role: str, name: str, attempt: str) -> Any:
        return next(
            (q for r, q in self._q_records() if r == role and (q.name, q.attempt) == (name, attempt)), None
        )

    def _q_has_record(self, role: str, name: str, attempt: str) -> bool:
        return self.tier(role).backend.exists(layout.quarantine_key(name, attempt))

    def _q_damageable(self) -> list[Manifest]:
        """Hot checkpoints committed in cold (their hot copy may go) and not damaged already."""
        cold = {(m.name, m.attempt) for m in self.tier("cold").manifests()}
        damaged = {(n, a) for n, a, _ in self.q_aside}
        return sorted(
            (m for m in self.tier("hot").manifests() if (m.name, m.attempt) in cold - damaged),
            key=lambda m: m.name,
        )

    def _q_move_aside(self, manifest: Manifest, path: str) -> None:
        hot = self.tier("hot")
        src = Path(self.store.hot) / hot.file_key(manifest.name, manifest.attempt, path)
        dst = self.root / "aside" / uuid.uuid4().hex
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        self.q_aside[(manifest.name, manifest.attempt, path)] = (src, dst)
        STATS.faults += 1

    def _q_put_back(self, name: str, attempt: str, path: str) -> None:
        src, dst = self.q_aside.pop((name, attempt, path))
        if not src.exists():
            src.parent.mkdir(parents=True, exist_ok=True)
            os.replace(dst, src)

    def _q_whole(self, role: str, manifest: Manifest) -> bool:
        tier = self.tier(role)
        return all(has_verified_copy(tier, manifest.name, manifest.attempt, f) for f in manifest.files)

    def _q_live(self, role: str, name: str, attempt: str) -> bool:
        found = self.tier(role).find_manifest(name)
        return found is not None and found.attempt == attempt

    # -- actors --------------------------------------------------------------------------

    def actor_quarantine(self, data: st.DataObject, *, a_in_flight: str | None) -> QStep:
        """A resume's quarantine of a hot checkpoint it says failed: a good copy, or one
        damaged on purpose (module docstring)."""
        hot = sorted(self.tier("hot").manifests(), key=lambda m: m.name)
        if not hot:
            return QStep("quarantine", lambda rank: None)
        damageable = self._q_damageable()
        damage = bool(damageable) and data.draw(st.booleans(), label="a copy damaged on purpose")
        manifest = data.draw(st.sampled_from(damageable if damage else hot), label="quarantine target")
        path = data.draw(
            st.sampled_from(sorted(f.path for f in manifest.files)), label="the file that failed"
        )
        seen = data.draw(st.sampled_from(["missing", "corrupt"]), label="what the resume saw")
        had = self._q_has_record("hot", manifest.name, manifest.attempt)
        if damage:
            self._q_move_aside(manifest, path)
        s, name, attempt = self.store, manifest.name, manifest.attempt

        def quarantine_(rank: int) -> bool | None:
            tier = Tier("hot", s.hot)
            here = tier.find_manifest(name)
            if here is None or here.attempt != attempt:
                return None
            context = {"checkpoint": name, "file": path, "tier": tier.label}
            failure = (
                ObjectNotFound("no such object", **context)
                if seen == "missing"
                else ChecksumMismatch.crc32c(0, 1, **context)
            )
            return quarantine_proven(tier, here, "the multi-actor machine's resume", [failure])

        return QStep(
            "quarantine",
            quarantine_,
            target=("hot", name, attempt),
            aside=path if damage else None,
            had_record=had,
        )

    def actor_q_restore(self, data: st.DataObject, *, a_in_flight: str | None) -> QStep:
        """`tierstore quarantine --restore NAME --attempt A`."""
        return self._q_operator("q-restore", data, restore_quarantined)

    def actor_q_delete(self, data: st.DataObject, *, a_in_flight: str | None) -> QStep:
        """`tierstore quarantine --delete NAME --attempt A --yes`."""
        return self._q_operator("q-delete", data, delete_quarantined)

    def _q_operator(self, kind: str, data: st.DataObject, command: Any) -> QStep:
        records = [(role, q) for role, q in self._q_records() if q.manifest is not None]
        planted, self.q_planted = self.q_planted, None
        records = [
            (role, q) for role, q in records if planted in (None, (role, q.name, q.attempt))
        ] or records
        if not records:
            return QStep(kind, lambda rank: None)
        role, record = data.draw(st.sampled_from(records), label=f"{kind} target")
        if kind == "q-delete":
            self.q_deleting.add((record.name, record.attempt))
        s, name, attempt = self.store, record.name, record.attempt

        def act(rank: int) -> str:
            store = TierStore.of(s.hot, s.cold, cold_options=s.options)
            try:
                command(store, name, attempt)
            except CheckpointExists:  # say at once whether the attempt was live: B runs next
                here = (store.hot if role == "hot" else store.cold).find_manifest(name)  # type: ignore[union-attr]
                return "refused: live" if here is not None and here.attempt == attempt else "refused"
            return "done"

        return QStep(kind, act, target=(role, name, attempt))

    # -- what each promised ----------------------------------------------------------------

    def _q_promise(self, kept: bool, broken: str) -> None:
        """Note a broken promise; :meth:`quarantine_actors_kept_their_promises` fails on it after
        the step (an invariant: how the suite's bug catchers tell a catch)."""
        if not kept:
            self.q_broken.append(broken)

    def check_quarantine(self, step: QStep, outcome: Any, *, faulted: bool) -> None:
        if step.target is None:
            self._q_promise(outcome.ok, f"quarantine: {outcome.errors}")
            return
        role, name, attempt = step.target
        if step.aside is not None:
            self.may_vanish["hot"].add(name)  # by policy: its damage was proven
            self._q_put_back(name, attempt, step.aside)
        if outcome.killed:
            return
        self._q_promise(outcome.ok, f"quarantine: {outcome.errors}")
        done = outcome.results[0]
        if step.aside is None:
            self._q_promise(done is not True, f"quarantined {name}, a good copy, on a resume's word")
            recorded = self._q_has_record(role, name, attempt)
            self._q_promise(step.had_record or not recorded, f"recorded {name} as damaged, a good copy")
        elif done and not self._q_live(role, name, attempt):
            record = self._q_record(role, name, attempt)
            self._q_promise(
                record is not None, f"quarantined {name} un-published, no record: gc takes its data"
            )
            if record is not None and record.manifest is not None and self._q_whole(role, record.manifest):
                self.q_kept.add((name, attempt))  # whole: kept so until a person acts

    def check_q_restore(self, step: QStep, outcome: Any, *, faulted: bool) -> None:
        if not self._q_operator_ok("q-restore", step, outcome, faulted):
            return
        assert step.target is not None
        role, name, attempt = step.target
        if outcome.killed:
            self._q_rerun_restore(role, name, attempt)
            return
        done = outcome.results[0]
        self._q_promise(
            done != "refused: live", f"restore of {name} refused to finish: the attempt is committed"
        )
        if done == "done":
            live, recorded = self._q_live(role, name, attempt), self._q_has_record(role, name, attempt)
            self._q_restored_by_a_person(role, name, attempt, live)
            # Restored, or quarantined again by a resume meanwhile: never neither, unless a
            # prune beside it took the checkpoint by policy once it was restored (the soak
            # found the restore of a planted record done before the prune it ran beside).
            pruned = name in self.may_vanish[role]  # type: ignore[attr-defined]
            self._q_promise(
                live != recorded or (pruned and not live and not recorded),
                f"restore of {name}: published {live}, recorded {recorded}",
            )

    def _q_restored_by_a_person(self, role: str, name: str, attempt: str, live: bool) -> None:
        """A person's ``--restore`` that published the attempt in the cold tier brings it back
        on purpose, even one the cold prune took by policy meanwhile (its data kept because
        it was quarantined: only a person may delete it). The soak found the model calling
        that a delivered checkpoint committed again: that invariant is about the migrator.
        A restore acts in every tier holding a record of the attempt, whichever record the
        person picked (``role``), so the cold tier is asked."""
        del role, live
        if self._q_live("cold", name, attempt):
            getattr(self, "_delivered_gone", set()).discard((name, attempt))

    def _q_rerun_restore(self, role: str, name: str, attempt: str) -> None:
        """A restore killed anywhere, even between its publish and its record delete, is
        finished by the next `--restore` (issue 34), never "delete it instead"."""
        s = self.store
        store = TierStore.of(s.hot, s.cold, cold_options=s.direct)
        if self._q_record(role, name, attempt) is None:
            return
        try:
            restore_quarantined(store, name, attempt)
        except IntegrityError as err:  # its data is not whole: refused, clearly
            self._q_promise("not whole" in str(err), f"re-run restore of {name}: {err!r}")
            return
        except Exception as err:
            self._q_promise(False, f"re-run restore of {name} did not finish it: {err!r}")
            return
        self._q_promise(self._q_live(role, name, attempt), f"re-run restore left {name} unpublished")
        self._q_restored_by_a_person(role, name, attempt, True)
        self._q_promise(not self._q_has_record(role, name, attempt), f"re-run restore left {name}'s record")

    def check_q_delete(self, step: QStep, outcome: Any, *, faulted: bool) -> None:
        if not self._q_operator_ok("q-delete", step, outcome, faulted):
            return
        assert step.target is not None
        role, name, attempt = step.target
        # At once: an un-publish by an actor still held would hide a live checkpoint's loss.
        live = self.tier(role).find_manifest(name)
        if live is not None and live.attempt == attempt:
            missing = [
                f.path
                for f in live.files
                if (name, attempt, f.path) not in self.q_aside
                and not has_verified_copy(self.tier(role), name, attempt, f)
            ]
            self._q_promise(not missing, f"delete took files {missing} of {name}, committed in {role}")
        if not outcome.killed:
            done = outcome.results[0]
            self._q_promise(done != "refused", f"delete of {name} refused, the attempt not committed")
            if done == "done":
                self._q_promise(
                    not self._q_has_record(role, name, attempt), f"delete of {name} left its record"
                )

    def _q_operator_ok(self, kind: str, step: QStep, outcome: Any, faulted: bool) -> bool:
        """Whether there is more to check: it acted on something, and was killed or returned."""
        if step.target is None:
            self._q_promise(outcome.ok, f"{kind}: {outcome.errors}")
            return False
        if outcome.killed or outcome.ok:
            return True
        kinds = set(outcome.error_types)
        allowed = REFUSALS | (SURFACED if faulted else {None})
        self._q_promise(kinds <= allowed, f"{kind}: {outcome.errors}")
        return False

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def quarantine_actors_kept_their_promises(self) -> None:
        broken, self.q_broken = self.q_broken, []
        assert not broken, broken[0]

    @invariant()
    def quarantined_data_is_kept_until_a_person_acts(self) -> None:
        """What a quarantine set aside whole stays whole while its record stands un-restored."""
        for name, attempt in sorted(self.q_kept):
            if (name, attempt) in self.q_deleting or not self._q_has_record("hot", name, attempt):
                self.q_kept.discard((name, attempt))
                continue
            if self._q_live("hot", name, attempt):
                self.q_kept.discard((name, attempt))  # restored: the machine's invariants hold it
                continue
            record = self._q_record("hot", name, attempt)
            assert (
                record is not None and record.manifest is not None and self._q_whole("hot", record.manifest)
            ), f"the data of quarantined {name} ({attempt}) went without a person deleting it"

    # -- rules -----------------------------------------------------------------------------

    def _q_in_both_tiers(self, data: st.DataObject) -> None:
        """Make sure a hot checkpoint committed in cold exists (one a quarantine may damage
        on purpose): a migrated save first, if none is."""
        if self._q_damageable():
            return
        step = self.actor("save", data, migrate=True)
        self.check(step, forking.run(step.fn, world=step.world), faulted=False)

    def _q_quarantined_one(self, data: st.DataObject) -> None:
        """Make sure a quarantined attempt exists (a resume's, of a copy damaged on purpose),
        so a held restore or delete has one to act on."""
        if any(q.manifest is not None for _, q in self._q_records()):
            return
        damageable = self._q_damageable()
        if not damageable:
            return
        manifest = data.draw(st.sampled_from(damageable), label="set aside first")
        path = sorted(f.path for f in manifest.files)[0]
        self._q_move_aside(manifest, path)
        hot = self.tier("hot")
        failure = ObjectNotFound("no such object", checkpoint=manifest.name, file=path, tier=hot.label)
        try:
            assert quarantine_proven(Tier("hot", self.store.hot), manifest, "set aside", [failure])
        finally:
            self.may_vanish["hot"].add(manifest.name)
            self._q_put_back(manifest.name, manifest.attempt, path)
        self.q_kept.add((manifest.name, manifest.attempt))

    def _q_plant(self, role: str, pick: int) -> tuple[str, str, str] | None:
        """What a `--restore` killed between its publish and its record delete leaves (or
        someone planted): a quarantine record naming the attempt committed now."""
        tier = self.tier(role)
        damaged = {(n, a) for n, a, _ in self.q_aside}
        live = sorted(
            (m for m in tier.manifests() if (m.name, m.attempt) not in damaged), key=lambda m: m.name
        )
        if not live:
            return None
        manifest = live[pick % len(live)]
        body = json.dumps({"manifest": manifest.to_json().decode(), "reason": "planted", "when": 0})
        try:
            tier.backend.publish(layout.quarantine_key(manifest.name, manifest.attempt), body.encode())
        except PublishConflict:
            pass
        STATS.faults += 1
        return role, manifest.name, manifest.attempt

    @rule(role=st.sampled_from(["hot", "cold"]), pick=st.integers(0, 1 << 16))
    def plant_a_record_for_a_live_attempt(self, role: str, pick: int) -> None:
        self._q_plant(role, pick)

    @rule(
        data=st.data(),
        role=st.sampled_from(["hot", "cold"]),
        a=st.sampled_from(["q-restore", "q-delete"]),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from((*BESIDE, "quarantine")),
        finish=st.sampled_from(["release", "kill"]),
    )
    def a_person_acts_on_a_record_of_a_live_attempt(
        self, data: st.DataObject, role: str, a: str, pick: int, b: str, finish: str
    ) -> None:
        """`--delete` (must delete nothing) or `--restore` (must finish) of a planted record,
        held at its gate (a delete refuses before it: never held) while B runs."""
        self.q_planted = self._q_plant(role, pick)
        if self.q_planted is None:
            return
        points = RESTORE if a == "q-restore" else DELETE
        self.force(data, a, points[pick % len(points)], b, "none", "none", finish)

    @rule(
        data=st.data(),
        point=st.sampled_from(QUARANTINE),
        b=st.sampled_from((*BESIDE, "q-restore", "q-delete")),
        wire_b=st.sampled_from(WIRE),
        finish=st.sampled_from(["release", "release", "kill"]),
    )
    def quarantine_held(self, data: st.DataObject, point: str, b: str, wire_b: str, finish: str) -> None:
        """A resume's quarantine held after its proof or its record while B runs."""
        self._q_in_both_tiers(data)
        self.force(data, "quarantine", point, b, wire_b, "none", finish)

    @rule(
        data=st.data(),
        a=st.sampled_from(["q-restore", "q-delete"]),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from((*BESIDE, "quarantine")),
        wire_b=st.sampled_from(WIRE),
        finish=st.sampled_from(["release", "release", "kill"]),
    )
    def quarantine_command_held(
        self, data: st.DataObject, a: str, pick: int, b: str, wire_b: str, finish: str
    ) -> None:
        """`--restore` held after its check or its publish, `--delete` after its check."""
        self._q_in_both_tiers(data)
        self._q_quarantined_one(data)
        points = RESTORE if a == "q-restore" else DELETE
        self.force(data, a, points[pick % len(points)], b, wire_b, "none", finish)

    @rule(
        data=st.data(),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from(["quarantine", "q-restore", "q-delete"]),
    )
    def load_or_gc_held_while_quarantine_acts(self, data: st.DataObject, pick: int, b: str) -> None:
        """A load held after its lease, or GC after its scan, while one of ours runs."""
        a = ("load", "gc")[pick % 2]
        self.force(data, a, POINTS[a][pick % len(POINTS[a])], b, "none", "none", "release")

    @rule(data=st.data(), point=st.sampled_from(POINTS["prune-hot"]))
    def prune_held_while_a_resume_quarantines(self, data: st.DataObject, point: str) -> None:
        """A hot prune that decided on a checkpoint, held while a resume quarantines it: the
        prune must leave the quarantined data (only a person removes it)."""
        for _ in range(2 - len(self._q_damageable())):  # two in both tiers: one for the prune
            step = self.actor("save", data, migrate=True)
            self.check(step, forking.run(step.fn, world=step.world), faulted=False)
        self.force(data, "prune-hot", point, "quarantine", "none", "none", "release")
