"""Many actors on one store at once: writers, two migrators of the same checkpoint (the
trainer's background migrator and `tierstore migrate` in another process), pruners, GC and
loaders, interleaved at fault points hypothesis picks, with the object store throttling,
resetting, stalling and refusing on the wire.

One rule step of :class:`MultiActor` forces one interleaving (gates.py): actor A starts in a
forked process and blocks at a fault point drawn for it; actor B runs to its end (with
object-store faults drawn for it); then A is released (with faults of its own) or SIGKILLed.
The cold tier is moto's S3 behind the fault proxy (s3_fault_proxy.py) for part of the
examples and a local directory (cheaper, no wire faults) for the others.

**A gate between every read and the act that depends on it** (docs/design.md invariant 19):
a prune held after its listing, after its cold check, between its re-check and its
un-publish, between its lease check and its deletes; a migration held between its marks
listing and its in-place check, and between that check and the cold commit; GC held between
its scan and its deletes; a load held after its lease. A prune of one tier runs on one
thread, so where it is held says exactly which view it decided from: the model plans each
prune from the store as it was when that prune listed it, and nothing else.

Invariants, after every step (checked through a direct, fault-free connection):

1. every file a manifest names is present in its tier and matches its CRC32C (nothing
   committed is lost or damaged in any tier: this machine damages nothing itself);
2. every checkpoint committed in a tier loads bit-exact from that tier alone;
3. a checkpoint leaves a tier only by a prune whose plan (from its own listing) dropped it;
   and, judged absolutely, a checkpoint attempt leaves the hot tier only once it has been
   committed in cold: the cold tier is looked at before and after every actor, so any
   commit an actor made is seen before a later prune could remove it again;
4. actors that returned did what they promised, and once the faults stop, `tierstore
   migrate` commits every pending checkpoint (a damaged upload mark must not block it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import forking
import model
import torch.distributed.checkpoint as dcp
from gates import Gate
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from stats import STATS

from tierstore import ReaderOptions, TieredReader, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import pending_in_cold, plan_prune, prune, prune_hot, prune_tier
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.migrator import MigrationState
from tierstore.migration.status import migrate_pending, migration_status
from tierstore.migration.transfer import has_verified_copy
from tierstore.retry import RetryPolicy
from tierstore.tiers.tier import Store as TierStore
from tierstore.tiers.tier import Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "s3" / "tests"))

PROFILE = os.environ.get("TIERSTORE_CRASH_PROFILE", "ci")
# A coordinator whose peers' marks never come waits commit_timeout: short, or one wrong
# wait costs the CI budget.
CONFIG = replace(model.FAST, commit_timeout=5)

# Where each actor may be held: every gate between a read and the act it decides.
MIGRATION = (
    "transfer.after_chunk",
    "migrator.after_file_upload",
    "migrator.before_mark_publish",
    "migrator.before_cold_publish",
    "migrator.after_cold_check",
    "migrator.after_cold_publish",
)
PRUNE = (
    "prune.after_listing",
    "prune.before_unpublish",
    "prune.after_unpublish",
    "prune.after_lease_check",
    "prune.after_file_delete",
)
POINTS: dict[str, tuple[str, ...]] = {
    "save": ("writer.after_file_write", "writer.before_manifest_publish", *MIGRATION),
    "migrate": MIGRATION,
    "prune-hot": ("prune.after_cold_check", *PRUNE),
    "prune-cold": PRUNE,
    "load": ("reader.after_lease", "reader.before_file"),
    "gc": ("gc.after_scan",),
}
# What may run while A is held: "prune" is both tiers at once, as the manager and
# `tierstore prune` run them.
ACTORS = ("save", "saves", "migrate", "prune", "prune-hot", "prune-cold", "load", "gc")
# Wire faults, on the proxy between the actors and moto (S3 examples only). Writes only:
# the invariants are about what is stored; reads fail the same way through the same code.
WIRE = (
    "none",
    "slowdown",
    "slowdown-storm",
    "reset",
    "lose-answer",
    "delay",
    "stall",
    "refuse",
    "deny-writes",
)
# What two migrators meet (B's list runs the other way: hypothesis starts from the first).
THROTTLED = ("slowdown-storm", "slowdown", "reset", "none")
OUTAGE = 0.3  # seconds a stall or refusal lasts
# What `tierstore migrate`, prune, GC or a load may raise while the cold tier misbehaves (a
# save never fails for it: migration is never allowed to fail training).
SURFACED = {None, "TransientStorageError", "StorageError"}


@dataclass(frozen=True)
class Store:
    hot: str
    cold: str
    options: dict[str, Any]  # the actors' cold options (through the proxy)
    direct: dict[str, Any]  # the checker's (straight to the server, no faults)


@dataclass
class Step:
    """One actor's run, as the machine planned it."""

    kind: str
    fn: Callable[[int], Any]
    world: int = 1
    save_step: int | None = None
    doomed: tuple[set[str], set[str]] = (set(), set())  # a prune's plan: hot, cold


class Machine(RuleBasedStateMachine):
    """The multi-actor machine's own actors and invariants; :class:`test_multi_actor.MultiActor`
    adds the actors' mixins (quarantine, delivery, operator commands, ...) on top."""

    s3: dict[str, Any] | None = None  # set by the S3 test: endpoint, bucket, proxy
    # Actors that upload to the cold tier while held (GC's grace must cover them); a mixin
    # adds its own.
    uploaders: tuple[str, ...] = ("save", "migrate")
    worlds: tuple[int, ...] = (1, 2)  # ranks a save may have

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierstore-multi-"))
        self.proxy = None
        if self.s3 is None:
            self.store = Store(str(self.root / "hot"), str(self.root / "cold"), {}, {})
        else:
            self.proxy = self.s3["proxy"]
            retry = RetryPolicy(attempts=2, deadline=10, initial=0.001, maximum=0.01)
            base = {"key": "testing", "secret": "testing", "region": "us-west-2", "retry": retry}
            self.store = Store(
                str(self.root / "hot"),
                f"s3://{self.s3['bucket']}/m-{uuid.uuid4().hex[:10]}",
                {**base, "endpoint_url": self.proxy.url},
                {**base, "endpoint_url": self.s3["endpoint"]},
            )
        self.next_step = 1
        self.seen: dict[str, set[str]] = {"hot": set(), "cold": set()}
        self.ever_hot: set[tuple[str, str]] = set()  # (name, attempt) ever committed there
        self.ever_cold: set[tuple[str, str]] = set()
        self.may_vanish: dict[str, set[str]] = {"hot": set(), "cold": set()}
        self.loaded: set[tuple[str, str, str]] = set()
        self.tiers = {
            "hot": Tier("hot", self.store.hot),
            "cold": Tier("cold", self.store.cold, self.store.direct),
        }
        self.gate_n = 0
        STATS.examples += 1

    def teardown(self) -> None:
        if self.proxy is not None:
            self.proxy.reset()
            self.proxy.mode = "healthy"
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the store as the checker sees it --------------------------------------------------

    def tier(self, role: str) -> Tier:
        return self.tiers[role]  # one client each: building an S3 client costs ~0.1 s

    def listed(self, role: str) -> dict[str, Manifest]:
        """The checkpoints committed in ``role``: name -> manifest."""
        return {m.name: m for m in self.tier(role).manifests()}

    def plan_prune(self, hot_keep: int | None, cold_keep: int | None) -> tuple[set[str], set[str]]:
        """What a prune that lists the store now deletes (``None``: that tier not pruned)."""
        hot, cold = self.tier("hot"), self.tier("cold")
        now = time.time()
        doomed_hot = (
            []
            if hot_keep is None
            else plan_prune(
                hot.manifests(), keep_last(hot_keep), protect=pending_in_cold(hot, cold), now=now
            )[0]
        )
        doomed_cold = (
            [] if cold_keep is None else plan_prune(cold.manifests(), keep_last(cold_keep), now=now)[0]
        )
        return {m.name for m in doomed_hot}, {m.name for m in doomed_cold}

    def look(self) -> None:
        """Remember every attempt committed in either tier now (invariant 3's evidence)."""
        self.ever_hot |= {(m.name, m.attempt) for m in self.tier("hot").manifests()}
        self.ever_cold |= {(m.name, m.attempt) for m in self.tier("cold").manifests()}

    # -- actors ----------------------------------------------------------------------------

    def actor(
        self, kind: str, data: st.DataObject, *, a_in_flight: str | None = None, migrate: bool | None = None
    ) -> Step:
        """The actor ``kind``, planned now; kinds beyond the ones below are a rule mixin's
        (``actor_<kind>``, with ``check_<kind>`` for what it promised: see the actors'
        mixins composed into :class:`MultiActor` at the end of this file)."""
        s = self.store
        extra = getattr(self, "actor_" + kind.replace("-", "_"), None)
        if extra is not None:
            return extra(data, a_in_flight=a_in_flight)
        if kind in ("save", "saves"):
            # "saves": a job saving twice while another actor is held (quick saves: two
            # commits inside one window of the other actor's).
            count = 2 if kind == "saves" else 1
            first_step, self.next_step = self.next_step, self.next_step + count
            world = data.draw(st.sampled_from(self.worlds), label="ranks")
            if migrate is None:
                migrate = data.draw(st.booleans(), label="the trainer migrates")
            mode = data.draw(st.sampled_from(["sync", "thread"]), label="save mode")

            def save(rank: int) -> list[tuple[str, str, str | None]]:
                states = []
                for step in range(first_step, first_step + count):
                    writer = TieredWriter(
                        TierStore.of(s.hot, s.cold if migrate else None, cold_options=s.options),
                        step=step,
                        migration=CONFIG,
                    )
                    states = model.save_and_migrate(writer, step, mode, 90)
                return states

            return Step("save", save, world, save_step=first_step + count - 1)
        if kind == "migrate":

            def migrate(rank: int) -> list[tuple[str, str, str | None]]:
                return [
                    (st_.name, st_.state.value, st_.error)
                    for st_ in migrate_pending(
                        TierStore.of(s.hot, s.cold, cold_options=s.options), config=CONFIG
                    )
                ]

            return Step("migrate", migrate)
        if kind in ("prune", "prune-hot", "prune-cold"):
            hot_keep = data.draw(st.integers(1, 3), label="hot keeps") if kind != "prune-cold" else None
            cold_keep = data.draw(st.integers(1, 3), label="cold keeps") if kind != "prune-hot" else None
            # Planned from the store as the prune is about to list it: nothing runs between
            # here and its listing (A starts now; B runs while A is held after its listing).
            doomed = self.plan_prune(hot_keep, cold_keep)

            def prune_(rank: int) -> None:
                store = TierStore.of_tiers(Tier("hot", s.hot), Tier("cold", s.cold, s.options))
                hot_tier, cold_tier = store.hot, store.cold
                assert hot_tier is not None and cold_tier is not None
                if kind == "prune-hot":
                    prune_hot(hot_tier, cold_tier, keep_last(hot_keep or 1))
                elif kind == "prune-cold":
                    prune_tier(cold_tier, keep_last(cold_keep or 1))
                else:
                    prune(store, hot_policy=keep_last(hot_keep or 1), cold_policy=keep_last(cold_keep or 1))

            return Step(kind, prune_, doomed=doomed)
        if kind == "load":

            def load(rank: int) -> tuple[str, bool] | None:
                if not list_checkpoints(TierStore.of(s.hot, s.cold, cold_options=s.options)):
                    return None
                target = model.blank()
                reader = TieredReader(
                    TierStore.of(s.hot, s.cold, cold_options=s.options), options=ReaderOptions(lease=True)
                )
                dcp.load(target, storage_reader=reader)
                assert reader.manifest is not None
                return reader.manifest.name, model.matches(target, reader.manifest.step)

            return Step("load", load)
        # GC's grace protects attempts still being written and copies still being uploaded
        # (by design they are no manifest's yet): zero only while no writer is in flight.
        grace = 3600.0 if a_in_flight in self.uploaders else 0.0

        def gc(rank: int) -> None:
            collect_garbage(TierStore.of(s.hot, s.cold, cold_options=s.options), grace=grace, dry_run=False)

        return Step("gc", gc)

    # -- wire faults -----------------------------------------------------------------------

    @contextmanager
    def wire(self, fault: str) -> Iterator[None]:
        """Object-store faults for the actors while the block runs (S3 examples only)."""
        proxy = self.proxy
        if proxy is None or fault == "none":
            yield
            return
        timer = None
        if fault == "slowdown":
            proxy.add("slowdown", method="PUT", times=3)
        elif fault == "slowdown-storm":  # outlasts every retry: uploads fail, are reported
            proxy.add("slowdown", method="PUT", times=1000)
        elif fault == "reset":
            proxy.add("reset", method="PUT", times=3)
        elif fault == "lose-answer":
            proxy.add("lose_answer", method="PUT", contains=(layout.MANIFEST_DIR + "/",))
        elif fault == "delay":
            proxy.add("delay", delay=0.1, times=5)
        else:  # the whole cold tier down for a moment: stalled, refusing, or read-only
            proxy.mode = {"stall": "stall", "refuse": "refuse", "deny-writes": "deny_writes"}[fault]
            if fault != "deny-writes":
                timer = threading.Timer(OUTAGE, lambda: setattr(proxy, "mode", "healthy"))
                timer.start()
        STATS.faults += 1
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            proxy.mode = "healthy"
            proxy.reset()

    # -- rules -----------------------------------------------------------------------------

    @rule(data=st.data())
    def save_alone(self, data: st.DataObject) -> None:
        step = self.actor("save", data)
        self.check(step, forking.run(step.fn, world=step.world), faulted=False)

    @rule(
        data=st.data(),
        a=st.sampled_from(tuple(POINTS)),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from(ACTORS),
        wire_b=st.sampled_from(WIRE),
        wire_a=st.sampled_from(WIRE),
        finish=st.sampled_from(["release", "release", "kill"]),
    )
    def interleave(
        self, data: st.DataObject, a: str, pick: int, b: str, wire_b: str, wire_a: str, finish: str
    ) -> None:
        """A blocks at a point; B runs to its end; A is released (or killed there)."""
        self.force(data, a, POINTS[a][pick % len(POINTS[a])], b, wire_b, wire_a, finish)

    @rule(
        data=st.data(),
        point=st.sampled_from(POINTS["migrate"]),
        wire_b=st.sampled_from(THROTTLED[::-1]),
        wire_a=st.sampled_from(THROTTLED),
    )
    def two_migrators_of_one_checkpoint(
        self, data: st.DataObject, point: str, wire_b: str, wire_a: str
    ) -> None:
        """The trainer's background migrator held mid-migration of its new checkpoint while
        `tierstore migrate` in another process migrates the same checkpoint, both throttled."""
        self.force(data, "save", point, "migrate", wire_b, wire_a, "release", migrate=True)

    def force(
        self,
        data: st.DataObject,
        a: str,
        point: str,
        b: str,
        wire_b: str,
        wire_a: str,
        finish: str,
        *,
        migrate: bool | None = None,
    ) -> None:
        first = self.actor(a, data, migrate=migrate)
        self.gate_n += 1
        gate = Gate(self.root / f"gate-{self.gate_n}")
        job = forking.start(first.fn, world=first.world, block=point, env=gate.env)
        try:
            held = gate.wait_reached(point, timeout=60, pid=job.pids[0])
            self.look()  # what A committed before its gate, before B can prune it
            second = self.actor(b, data, a_in_flight=a if held else None)
            with self.wire(wire_b):
                outcome_b = forking.run(second.fn, world=second.world)
            self.look()
            self.check(second, outcome_b, faulted=wire_b != "none")
            with self.wire(wire_a):
                if finish == "kill" and held:
                    job.kill()
                    STATS.faults += 1
                gate.release(point)
                outcome_a = job.wait(120)
        except BaseException:
            job.kill()
            job.wait(10)
            raise
        STATS.steps += 1
        if held:
            STATS.crash_points.add(point)
        self.last = (a, point, b, wire_b, wire_a, finish)
        self.check(first, outcome_a, faulted=wire_a != "none" or wire_b != "none")

    @rule(pick=st.integers(0, 1 << 16))
    def replace_an_uploaded_object(self, pick: int) -> None:
        """Someone who can write the bucket puts other bytes of the same size where a pending
        checkpoint's rank uploaded and verified a file (docs/design.md invariant 10): no cold
        commit may vouch for them, and the next migration uploads the file again."""
        hot, cold = self.tier("hot"), self.tier("cold")
        uploaded = []
        for name in sorted(pending_in_cold(hot, cold)):
            manifest = hot.find_manifest(name)
            if manifest is None or not list(cold.backend.list(layout.upload_prefix(name, manifest.attempt))):
                continue
            for entry in manifest.files:
                key = cold.file_key(name, manifest.attempt, entry.path)
                if cold.backend.exists(key) and entry.size:
                    uploaded.append((key, entry))
        if not uploaded:
            return
        key, entry = uploaded[pick % len(uploaded)]
        data = bytearray(cold.backend.read_bytes(key))
        data[pick % len(data)] ^= 0xFF
        with cold.backend.open_write(key) as out:
            out.write(bytes(data))
        STATS.faults += 1

    @rule(
        kind=st.sampled_from(["truncated", "wrong-rank", "garbage", "other-files"]),
        pick=st.integers(0, 1 << 16),
    )
    def damage_an_upload_mark(self, kind: str, pick: int) -> None:
        """An upload mark torn or forged (a crash on a store without atomic writes, a
        careless tool): a hint, never to be trusted, and never allowed to block migration."""
        hot, cold = self.tier("hot"), self.tier("cold")
        pending = sorted(pending_in_cold(hot, cold))
        if not pending:
            return
        manifest = hot.find_manifest(pending[pick % len(pending)])
        assert manifest is not None
        rank = sorted({f.rank for f in manifest.files})[0]
        files = [
            {"path": f.path, "size": f.size, "crc32c": f.crc32c, "rank": f.rank}
            for f in manifest.files_of_rank(rank)
        ]
        good = json.dumps({"rank": rank, "files": files}, sort_keys=True).encode()
        body = {
            "truncated": good[: len(good) // 2],
            "garbage": b"\x00\xffnot json",
            "wrong-rank": json.dumps({"rank": rank + 1, "files": files}).encode(),
            "other-files": json.dumps({"rank": rank, "files": files[:-1]}).encode(),
        }[kind]
        key = layout.upload_mark_key(manifest.name, manifest.attempt, rank)
        cold.backend.delete(key)
        cold.backend.publish(key, body)
        STATS.faults += 1

    @rule()
    def migrate_once_the_faults_stop(self) -> None:
        """`tierstore migrate` on a healthy store commits every pending checkpoint."""
        s = self.store
        outcome = forking.run(
            lambda rank: [
                (x.name, x.state.value, x.error)
                for x in migrate_pending(TierStore.of(s.hot, s.cold, cold_options=s.options), config=CONFIG)
            ]
        )
        STATS.steps += 1
        assert outcome.ok, outcome.errors
        stuck = [x for x in outcome.results[0] if x[1] != "committed"]
        assert not stuck, f"migration blocked on a healthy store: {stuck}"
        statuses = migration_status(TierStore.of(s.hot, s.cold, cold_options=s.direct))
        assert all(x.state is MigrationState.COMMITTED for x in statuses), statuses

    # -- what each actor promised ------------------------------------------------------------

    def check(self, step: Step, outcome: forking.Outcome, *, faulted: bool) -> None:
        extra = getattr(self, "check_" + step.kind.replace("-", "_"), None)
        if extra is not None:
            extra(step, outcome, faulted=faulted)
            return
        self.check_generic(step, outcome, faulted=faulted)

    def check_generic(self, step: Step, outcome: forking.Outcome, *, faulted: bool) -> None:
        """What the machine's own actors promised (a mixin's check may end with this)."""
        if step.kind.startswith("prune"):
            self.may_vanish["hot"] |= step.doomed[0]
            self.may_vanish["cold"] |= step.doomed[1]
        if outcome.killed:
            return
        if faulted and step.kind != "save" and set(outcome.error_types) <= SURFACED:
            return  # a tool may give up on an unreachable cold tier, clearly, losing nothing
        assert outcome.ok, f"{step.kind}: {outcome.errors}"
        if step.kind == "save":
            assert step.save_step is not None
            assert layout.default_name(step.save_step) in self.listed("hot"), "a returned save is committed"
            states = [x for result in outcome.results for x in result]
            if not faulted:
                assert all(x[1] in ("uploaded", "committed") for x in states), states
        elif step.kind == "migrate" and not faulted:
            stuck = [x for x in outcome.results[0] if x[1] != "committed"]
            assert not stuck, f"migration failed with no fault injected: {stuck}"
        elif step.kind.startswith("prune") and not faulted:
            # What its plan dropped is gone (un-published) once it returns: a prune that
            # could not confirm a cold copy keeps the hot one, but only under wire faults.
            doomed_hot, doomed_cold = step.doomed
            left = (doomed_hot & set(self.listed("hot"))) | (doomed_cold & set(self.listed("cold")))
            assert not left, f"prune returned but left {sorted(left)}"
        elif step.kind == "load" and outcome.results[0] is not None:
            name, exact = outcome.results[0]
            assert exact, f"load of {name} returned wrong bytes"

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def every_file_a_manifest_names_is_stored_intact(self) -> None:
        for role in ("hot", "cold"):
            tier = self.tier(role)
            for manifest in tier.manifests():
                bad = [
                    f.path
                    for f in manifest.files
                    if not has_verified_copy(tier, manifest.name, manifest.attempt, f)
                ]
                assert not bad, f"{role} manifest of {manifest.name} names missing or damaged files {bad}"

    @invariant()
    def every_committed_checkpoint_loads_from_its_tier(self) -> None:
        s = self.store
        for role in ("hot", "cold"):
            for name, manifest in self.listed(role).items():
                if (role, name, manifest.attempt) in self.loaded:
                    continue  # loaded already: its files are re-checked every step above
                target = model.blank()
                reader = (
                    TieredReader(s.hot, None, name=name, options=ReaderOptions(lease=False))
                    if role == "hot"
                    else TieredReader(
                        TierStore.of(None, s.cold, cold_options=s.direct),
                        name=name,
                        options=ReaderOptions(lease=False),
                    )
                )
                try:
                    dcp.load(target, storage_reader=reader)
                except BaseException as err:
                    raise AssertionError(
                        f"{role} copy of {name} does not load: {model.unwrap(err)!r}"
                    ) from err
                assert manifest.step is not None and model.matches(target, manifest.step), (
                    f"{role} copy of {name} loaded wrong bytes"
                )
                self.loaded.add((role, name, manifest.attempt))

    @invariant()
    def nothing_leaves_a_tier_but_by_policy_and_hot_only_once_in_cold(self) -> None:
        now = {role: set(self.listed(role)) for role in ("hot", "cold")}
        self.look()
        for role in ("hot", "cold"):
            gone = self.seen[role] - now[role]
            assert gone <= self.may_vanish[role], f"{role}: {sorted(gone - self.may_vanish[role])} vanished"
            self.seen[role] = now[role]
            self.may_vanish[role] = set()
        # Absolute (no plan excuses it): an attempt leaves the hot tier only once committed
        # in cold, as seen before or after some actor ran.
        in_hot = {(m.name, m.attempt) for m in self.tier("hot").manifests()}
        lost = (self.ever_hot - in_hot) - self.ever_cold
        assert not lost, f"left the hot tier without ever being committed in cold: {sorted(lost)}"
