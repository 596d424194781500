"""The crash-consistency state machine: random saves, migrations, prunes, loads, corruptions
and recoveries, each possibly SIGKILLed at any fault point it passes.

Each operation runs in forked children (see ``forking``); one rule saves while the cold tier
is unreachable (its mount point replaced by a file) and migrates once it is back. Before running it for real, the
machine runs it once on a scratch copy of the store with tracing on, learns the fault points
it passes, and lets hypothesis pick one as the crash point (or none), so every crash lands
on a real point and every example replays deterministically.

Invariants checked after every step:

1. every checkpoint listed as committed in a tier loads bit-exact from that tier alone, or,
   if the test damaged that copy, the damage is detected (an error, never wrong data);
2. a load through both tiers returns the right bytes whenever one intact copy exists;
3. nothing committed disappears except by retention policy (so the newest committed
   checkpoint before a crash is still committed after it);
4. an operation that returned normally did what it promised (a save is committed, a
   migration committed every intact pending checkpoint, a prune removed exactly its plan,
   a GC left no garbage).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forking
import model
import torch.distributed.checkpoint as dcp
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from stats import STATS

from tierstore import Store, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import pending_in_cold, plan_prune, prune
from tierstore.lifecycle.retention import Policy, keep_every, keep_last
from tierstore.migration.migrator import MigrationState
from tierstore.migration.status import migrate_pending, migration_status
from tierstore.migration.transfer import has_verified_copy
from tierstore.tiers.tier import Tier

Op = Callable[[str, str, int], Any]  # (hot, cold, rank) -> result


class CrashConsistency(RuleBasedStateMachine):
    # A fault point to crash at whenever the victim's trace passes it, instead of the point
    # drawn (the draw is still made, so examples keep their shape). None: every crash drawn.
    aim: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierstore-crash-"))
        # The cold tier sits under a "mount point" that save_while_cold_is_down takes away.
        self.hot, self.cold = str(self.root / "hot"), str(self.root / "mnt" / "cold")
        self.next_step = 1
        # Copies the test damaged on purpose: only these may fail to load. (Whether a copy
        # is *actually* damaged is computed by _damaged: two flips of one byte cancel.)
        self.touched: set[tuple[str, str]] = set()
        self.seen: dict[str, set[str]] = {"hot": set(), "cold": set()}
        self.may_vanish: dict[str, set[str]] = {"hot": set(), "cold": set()}
        STATS.examples += 1

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------

    def _root(self, role: str) -> str:
        return self.hot if role == "hot" else self.cold

    def _damaged(self, role: str, name: str) -> bool:
        """Does this tier's copy differ from its manifest? (Two flips of one byte cancel.)"""
        tier = Tier(role, self._root(role))
        manifest = tier.find_manifest(name)
        return manifest is not None and any(
            not has_verified_copy(tier, name, manifest.attempt, entry) for entry in manifest.files
        )

    def _listed(self, role: str) -> dict[str, Any]:
        hot, cold = (self.hot, None) if role == "hot" else (None, self.cold)
        return {c.name: c for c in list_checkpoints(Store.of(hot, cold))}

    def _run(self, data: st.DataObject, op: Op, world: int = 1) -> forking.Outcome:
        """Trace ``op`` on a copy of the store, pick a crash point among those it passed,
        then run it for real."""
        scratch = Path(tempfile.mkdtemp(prefix="tierstore-trace-"))
        try:
            for role in ("hot", "cold"):
                if Path(self._root(role)).exists():
                    shutil.copytree(self._root(role), scratch / role, symlinks=True)
            hot, cold = str(scratch / "hot"), str(scratch / "cold")
            traced = forking.run(lambda rank: op(hot, cold, rank), world=world)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        victim = data.draw(st.integers(0, world - 1), label="victim rank")
        passed = len(traced.points[victim])
        # Drawn from a fixed range and mapped onto the points this run passed, so the draws
        # are the same whatever the trace length: examples shrink and replay.
        # A wide range taken modulo the points passed spreads crashes over the whole
        # operation (small draws, which hypothesis favours, alone would mostly hit the first).
        pick = data.draw(st.one_of(st.none(), st.integers(0, 1 << 31)), label="crash at point")
        crash = None if pick is None or not passed else 1 + pick % passed
        if self.aim is not None and self.aim in traced.points[victim]:
            crash = 1 + traced.points[victim].index(self.aim)
        outcome = forking.run(
            lambda rank: op(self.hot, self.cold, rank), world=world, crash_at=crash, victim=victim
        )
        self.last = (op.__qualname__, world, victim, crash, outcome)
        STATS.steps += 1
        if outcome.killed:
            STATS.faults += 1
            if outcome.died_at:
                STATS.crash_points.add(outcome.died_at)
        return outcome

    # -- rules ---------------------------------------------------------------------------

    @rule(
        data=st.data(),
        world=st.sampled_from([1, 2]),
        per_item=st.booleans(),
        with_cold=st.booleans(),
        mode=st.sampled_from(["sync", "thread"]),
    )
    def save(self, data: st.DataObject, world: int, per_item: bool, with_cold: bool, mode: str) -> None:
        step, self.next_step = self.next_step, self.next_step + 1

        def op(hot: str, cold: str, rank: int) -> list[tuple[str, str, str | None]]:
            writer = TieredWriter(
                hot,
                cold if with_cold else None,
                step=step,
                single_file_per_rank=not per_item,
                migration=model.FAST,
            )
            return model.save_and_migrate(writer, step, mode, 60)

        outcome = self._run(data, op, world)
        if outcome.killed:
            return
        assert outcome.ok, outcome.errors
        name = layout.default_name(step)
        assert name in self._listed("hot"), "a save that returned must be committed"
        if with_cold:
            states = [s for result in outcome.results for s in result]
            assert all(state in ("uploaded", "committed") for _, state, _ in states), states
            assert name in self._listed("cold"), "its migration finished, so it is committed cold"

    @rule(data=st.data())
    def migrate(self, data: st.DataObject) -> None:
        def op(hot: str, cold: str, rank: int) -> list[tuple[str, str, str | None]]:
            return [
                (s.name, s.state.value, s.error)
                for s in migrate_pending(Store.of(hot, cold), config=model.FAST)
            ]

        outcome = self._run(data, op)
        if outcome.killed:
            return
        assert outcome.ok, outcome.errors
        for name, state, error in outcome.results[0]:
            if state != "committed":  # only a source the test damaged may fail to migrate
                assert ("hot", name) in self.touched, (name, state, error)
        for status in migration_status(Store.of(self.hot, self.cold)):
            if not self._damaged("hot", status.name):
                assert status.state is MigrationState.COMMITTED, status

    @rule(
        data=st.data(),
        hot_keep=st.integers(1, 3),
        cold_keep=st.integers(1, 3),
        every=st.sampled_from([0, 2, 3]),
    )
    def prune(self, data: st.DataObject, hot_keep: int, cold_keep: int, every: int) -> None:
        hot_policy: Policy = keep_last(hot_keep)
        cold_policy: Policy = keep_last(cold_keep) | keep_every(every) if every else keep_last(cold_keep)
        hot, cold = Tier("hot", self.hot), Tier("cold", self.cold)
        now = time.time()
        doomed_hot = {
            m.name
            for m in plan_prune(hot.manifests(), hot_policy, protect=pending_in_cold(hot, cold), now=now)[0]
        }
        doomed_cold = {m.name for m in plan_prune(cold.manifests(), cold_policy, now=now)[0]}
        self.may_vanish["hot"] |= doomed_hot
        self.may_vanish["cold"] |= doomed_cold

        def op(hot_url: str, cold_url: str, rank: int) -> None:
            prune(Store.of(hot_url, cold_url), hot_policy=hot_policy, cold_policy=cold_policy)

        outcome = self._run(data, op)
        if outcome.killed:
            return
        assert outcome.ok, outcome.errors
        assert not doomed_hot & set(self._listed("hot")) and not doomed_cold & set(self._listed("cold"))

    @rule(data=st.data())
    def load_latest(self, data: st.DataObject) -> None:
        listed = {**self._listed("cold"), **self._listed("hot")}

        def op(hot: str, cold: str, rank: int) -> tuple[str, bool]:
            target, reader = model.load(hot, cold, lease=True)
            assert reader.manifest is not None
            return reader.manifest.name, model.matches(target, reader.manifest.step)

        outcome = self._run(data, op)
        if outcome.killed:
            return
        if not listed:
            assert outcome.error_types[0] == "CheckpointNotFound", outcome.errors
            return
        newest = max(listed.values(), key=lambda c: c.step)
        holders = [role for role in ("hot", "cold") if newest.name in self._listed(role)]
        if outcome.ok:
            name, exact = outcome.results[0]
            assert exact, outcome.results
            # A load without a name skips a candidate damaged in every tier holding it for
            # the next older one (docs/design.md, "A load"): every checkpoint newer than the
            # one it loaded must have been damaged (touched) wherever it was committed.
            loaded = listed[name].step
            skipped = [c.name for c in listed.values() if c.step > loaded]
            untouched = [
                n
                for n in skipped
                for role in ("hot", "cold")
                if n in self._listed(role) and (role, n) not in self.touched
            ]
            assert not untouched, (outcome.results, newest.name, untouched)
        else:  # per-file fallback can succeed even with both copies damaged; failing needs one
            assert all((role, newest.name) in self.touched for role in holders), outcome.errors
            assert outcome.error_types[0] in ("ChecksumMismatch", "ObjectNotFound", "IntegrityError"), (
                outcome.errors
            )

    @rule(world=st.sampled_from([1, 2]), mode=st.sampled_from(["sync", "thread"]))
    def save_while_cold_is_down(self, world: int, mode: str) -> None:
        """The cold tier unreachable while a job saves: the save commits on hot, migration
        fails and says so (never into training), and `tierstore migrate` finishes it later."""
        step, self.next_step = self.next_step, self.next_step + 1
        mount = Path(self.cold).parent
        mount.mkdir(parents=True, exist_ok=True)
        away = mount.with_name("mnt.away")

        def op(rank: int) -> list[str]:
            writer = TieredWriter(self.hot, self.cold, step=step, migration=model.FAST)
            if mode == "sync":
                dcp.save(model.state_for(step), storage_writer=writer)
            else:
                dcp.async_save(model.state_for(step), storage_writer=writer).result()
            assert writer.migrator is not None
            writer.migrator.wait(60)
            return [s.state.value for s in writer.migrator.status()]

        # A regular file where the mount point was: every path under it fails (ENOTDIR), even
        # for root, whom no permission bit stops; as an unmounted or vanished volume does.
        mount.rename(away)
        mount.write_bytes(b"")
        try:
            outcome = forking.run(op, world=world)
        finally:
            mount.unlink()
            away.rename(mount)
        STATS.steps += 1
        STATS.faults += 1
        assert outcome.ok, f"a save failed because the cold tier was down: {outcome.errors}"
        assert layout.default_name(step) in self._listed("hot"), "a save that returned must be committed"
        assert "committed" not in {s for states in outcome.results for s in states}, outcome.results
        back = forking.run(
            lambda rank: [
                (s.name, s.state.value, s.error)
                for s in migrate_pending(Store.of(self.hot, self.cold), config=model.FAST)
            ]
        )
        assert back.ok, back.errors
        for status in migration_status(Store.of(self.hot, self.cold)):
            if not self._damaged("hot", status.name):
                assert status.state is MigrationState.COMMITTED, (status, back.results)

    # Every draw below comes from a fixed range and is mapped onto what the store holds, so
    # generation never depends on store state (two-rank crashes make that state racy).
    @rule(
        kind=st.sampled_from(["flip", "truncate", "delete"]),
        which=st.integers(0, 1 << 16),
        file_pick=st.integers(0, 1 << 16),
        where=st.integers(0, 1 << 30),
    )
    def corrupt_a_file(self, kind: str, which: int, file_pick: int, where: int) -> None:
        choices = sorted((role, name) for role in ("hot", "cold") for name in self._listed(role))
        if not choices:
            return
        role, name = choices[which % len(choices)]
        tier = Tier(role, self._root(role))
        manifest = tier.find_manifest(name)
        assert manifest is not None
        files = sorted(manifest.files, key=lambda f: f.path)
        entry = files[file_pick % len(files)]
        path = Path(self._root(role), tier.file_key(name, manifest.attempt, entry.path))
        if path.exists():
            raw = bytearray(path.read_bytes())
            if kind == "delete" or not raw:
                path.unlink()
            elif kind == "truncate":
                path.write_bytes(bytes(raw[: where % len(raw)]))
            else:
                raw[where % len(raw)] ^= 0xFF
                path.write_bytes(bytes(raw))
        self.touched.add((role, name))
        STATS.faults += 1

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """What an operator runs after crashes: collect garbage, finish migrations."""

        def op(hot: str, cold: str, rank: int) -> None:
            collect_garbage(Store.of(hot, cold), grace=0, dry_run=False)
            migrate_pending(Store.of(hot, cold), config=model.FAST)

        outcome = self._run(data, op)
        if outcome.killed:
            return
        assert outcome.ok, outcome.errors
        assert find_garbage(Store.of(self.hot, self.cold), grace=0) == []

    # -- invariants ----------------------------------------------------------------------

    def _check(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except AssertionError as err:
            STATS.violations += 1
            STATS.messages.append(str(err)[:500])
            raise

    @invariant()
    def listed_checkpoints_load_or_their_damage_is_detected(self) -> None:
        def check() -> None:
            for role in ("hot", "cold"):
                hot, cold = (self.hot, None) if role == "hot" else (None, self.cold)
                for name, info in self._listed(role).items():
                    try:
                        target, _ = model.load(hot, cold, name)
                    except BaseException as err:
                        inner = model.unwrap(err)
                        assert (role, name) in self.touched, f"{role} copy of {name} does not load: {inner!r}"
                        assert isinstance(inner, model.DETECTED), inner
                        continue
                    assert not self._damaged(role, name), f"damaged {role} copy of {name} loaded"
                    assert model.matches(target, info.step), f"{role} copy of {name} loaded wrong bytes"

        self._check(check)

    @invariant()
    def a_load_through_both_tiers_uses_any_intact_copy(self) -> None:
        def check() -> None:
            both = set(self._listed("hot")) & set(self._listed("cold"))
            for name in sorted(both):
                step = self.steps_of(name)
                try:
                    target, _ = model.load(self.hot, self.cold, name)
                except BaseException as err:
                    assert ("hot", name) in self.touched and ("cold", name) in self.touched, repr(
                        model.unwrap(err)
                    )
                    continue
                assert model.matches(target, step), f"{name} loaded wrong bytes through both tiers"

        self._check(check)

    @invariant()
    def nothing_committed_disappears_except_by_policy(self) -> None:
        def check() -> None:
            for role in ("hot", "cold"):
                now = set(self._listed(role))
                gone = self.seen[role] - now
                assert gone <= self.may_vanish[role], (
                    f"{role}: {sorted(gone - self.may_vanish[role])} vanished"
                )
                self.seen[role] = now
                self.may_vanish[role] = set()
                self.touched -= {(role, name) for name in gone}

        self._check(check)

    @staticmethod
    def steps_of(name: str) -> int:
        return int(name.split("-")[1])
