"""Delivery's actors for the multi-actor machine (docs/design.md invariants 22, 25, 26).

* ``deliver``: a manager's maintenance round resuming pending migrations: it looks at the
  cold tier (what is pending), then queues a full migration of each, from that view. Held
  between its view and its queueing (``delivery.before_queue``), between a job's look at
  the hot tier's migrated mark and its uploads (``migrator.after_delivered_check``), and
  between its own mark and its listing of everyone's (``migrator.before_marks_listing``).
  It promises: with no fault, every job it ran ends committed (or found delivered), never
  failed or waiting for a mark that a commit or a prune took meanwhile.
* ``close``: a run's end: a ``CheckpointManager`` (keeping everything) saves a step and
  closes, its delivery spending the deadline trying. Held where a delivery decides; with a
  cold tier that refuses or stalls for a moment (wire faults on S3), it still delivers;
  what it names undelivered is really pending (in the hot tier, not in the cold one).

:meth:`DeliveryActors.deliver_between_two_actors` holds a ``deliver`` at two gates in turn,
with another actor run at each: its view made stale by a migration, then the attempt pruned
from the cold tier by policy while its commit waits for marks (the hang the outside test
found: a duplicate job polling ``commit_timeout`` for its own mark, the queue behind it).

Invariant added: a checkpoint attempt pruned from the cold tier never comes back to it (a
stale job re-committing what the cold policy removed).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import forking
import model
from gates import Gate
from gates import exited as forking_exited
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from multi_actor import CONFIG, MIGRATION, SURFACED, Machine, Step
from stats import STATS

from tierstore.errors import MigrationFailed
from tierstore.format import layout
from tierstore.lifecycle.prune import check_cold_copies, plan_prune
from tierstore.lifecycle.retention import Retention, keep_all, keep_last
from tierstore.migration.delivery import resume_pending
from tierstore.migration.migrator import Migrator
from tierstore.options import ManagerOptions
from tierstore.tiers import marks
from tierstore.tiers.tier import Store as TierStore

__all__ = ["DeliveryActors"]

DELIVER = (
    "delivery.before_queue",
    "migrator.after_delivered_check",
    "migrator.before_marks_listing",
    "migrator.before_cold_publish",
    "migrator.after_cold_check",
)
CLOSE = ("delivery.before_queue", "migrator.before_marks_listing", "migrator.before_probe", *MIGRATION)
# Wire faults a run's end must ride out within its deadline (20 s): the others (a storm of
# refusals that outlasts it, a tier that denies writes all along) may leave it pending.
BLIPS = {"none", "slowdown", "reset", "lose-answer", "delay", "stall", "refuse"}
CLOSE_TIMEOUT = 20.0


class DeliveryActors:
    """A mixin of :class:`multi_actor.Machine` (its attributes are the machine's)."""

    uploaders: tuple[str, ...] = ("save", "migrate", "deliver", "close")
    store: Any
    next_step: int

    # -- actors ----------------------------------------------------------------------------

    def actor_deliver(self, data: st.DataObject, *, a_in_flight: str | None = None) -> Step:
        s = self.store

        def deliver(rank: int) -> list[tuple[str, str, str | None]]:
            store = TierStore.of(s.hot, s.cold, cold_options=s.options)
            assert store.hot is not None and store.cold is not None
            began = time.monotonic()
            view = check_cold_copies(store.hot, store.cold).pending  # the round's look
            migrator = Migrator(store.hot, store.cold, CONFIG)
            resume_pending(migrator, store.hot, view, since=began)
            migrator.wait(90)
            return [(x.name, x.state.value, x.error) for x in migrator.status()]

        return Step("deliver", deliver)

    def check_deliver(self, step: Step, outcome: forking.Outcome, *, faulted: bool) -> None:
        if outcome.killed or (faulted and set(outcome.error_types) <= SURFACED):
            return
        assert outcome.ok, f"deliver: {outcome.errors}"
        if not faulted:
            stuck = [x for x in outcome.results[0] if x[1] not in ("committed", "uploaded")]
            assert not stuck, f"a resumed migration failed or waited with no fault injected: {stuck}"

    def actor_close(self, data: st.DataObject, *, a_in_flight: str | None = None) -> Step:
        s = self.store
        step = self.next_step
        self.next_step += 1

        def close(rank: int) -> tuple[str, list[str]]:
            from tierstore import CheckpointManager

            manager = CheckpointManager(
                TierStore(s.hot, s.cold, cold_options=s.options),
                retention=Retention(hot=keep_all(), cold=keep_all(), hot_min_free=None),
                migration=CONFIG,
                preemption=False,
                options=ManagerOptions(close_timeout=CLOSE_TIMEOUT),
            )
            manager.save(step, model.state_for(step), force=True)
            try:
                manager.close()
            except MigrationFailed as err:
                return "undelivered", list(err.checkpoints)
            return "delivered", []

        return Step("close", close, save_step=step)

    def check_close(self, step: Step, outcome: forking.Outcome, *, faulted: bool) -> None:
        if outcome.killed:
            return
        assert outcome.ok, f"close: {outcome.errors}"
        how, left = outcome.results[0]
        hot, cold = set(self.listed("hot")), set(self.listed("cold"))  # type: ignore[attr-defined]
        for name in left:  # named undelivered: really pending, nothing false
            assert name in hot and name not in cold, (
                f"close() named {name} undelivered: hot {hot}, cold {cold}"
            )
        if not faulted or self._wire_a in BLIPS:
            assert how == "delivered", f"a run's end left {left} pending after a blip ({self._wire_a})"

    # -- what a prune beside them may take ------------------------------------------------

    _threads_go_on = False  # A is a manager or a round: its other threads run while one is held

    def plan_prune(self, hot_keep: int | None, cold_keep: int | None) -> tuple[set[str], set[str]]:
        """The machine plans a prune from the store as it will list it, A being held. A run's
        end or a round is held on one thread while its others go on (a migration of what
        it resumed, its own commit): the cold tier the prune lists may hold any of the hot
        tier's pending checkpoints as well, so what it may drop is what keep_last drops
        from that listing with all of them committed (adding checkpoints only pushes more
        out). Hot prunes are not run beside them (A's own save may land in the listing)."""
        machine: Any = self
        if not self._threads_go_on:
            return Machine.plan_prune(machine, hot_keep, cold_keep)
        assert hot_keep is None, "no hot prune beside a run's end or a round"
        cold, hot = machine.tier("cold"), machine.tier("hot")
        listed = {m.name: m for m in cold.manifests()}
        may_land = [m for m in hot.manifests() if m.name not in listed]
        doomed = plan_prune([*listed.values(), *may_land], keep_last(cold_keep or 1), now=time.time())[0]
        # What it must drop whatever landed: the plan from the listing alone (adding
        # checkpoints never saves one keep_last drops). Judged by check_prune_cold.
        self._must_drop = frozenset(Machine.plan_prune(machine, None, cold_keep)[1])
        return set(), {m.name for m in doomed}

    _must_drop: frozenset[str] = frozenset()

    def check_prune_cold(self, step: Step, outcome: forking.Outcome, *, faulted: bool) -> None:
        """Beside a run's end or a round, a cold prune may drop up to its plan with every
        pending checkpoint landed, and must drop at least its plan from the listing alone."""
        machine: Any = self
        if self._threads_go_on:
            machine.may_vanish["cold"] |= step.doomed[1]
            step = replace(step, doomed=(set(), set(self._must_drop)))
        Machine.check_generic(machine, step, outcome, faulted=faulted)

    # -- rules -----------------------------------------------------------------------------

    _wire_a = "none"

    @rule(
        data=st.data(),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from(("migrate", "prune-cold", "save", "gc", "load")),
        wire_a=st.sampled_from(("none", "refuse", "stall", "slowdown", "deny-writes")),
    )
    def close_held_while_another_runs(self, data: st.DataObject, pick: int, b: str, wire_a: str) -> None:
        """A run's end held where its delivery decides, another actor run to its end; then
        the cold tier blips (S3) while it finishes."""
        machine: Any = self
        self._wire_a = wire_a if machine.proxy is not None else "none"
        self._threads_go_on = True
        try:
            machine.force(data, "close", CLOSE[pick % len(CLOSE)], b, "none", wire_a, "release")
        finally:
            self._threads_go_on = False

    @rule(
        data=st.data(),
        pick=st.integers(0, 1 << 16),
        b=st.sampled_from(("migrate", "saves", "prune-cold", "gc")),
    )
    def deliver_held_while_another_runs(self, data: st.DataObject, pick: int, b: str) -> None:
        machine: Any = self
        self._wire_a = "none"
        self._threads_go_on = True
        try:
            machine.force(data, "deliver", DELIVER[pick % len(DELIVER)], b, "none", "none", "release")
        finally:
            self._threads_go_on = False

    @rule(data=st.data(), first=st.sampled_from(DELIVER[:2]))
    def deliver_between_two_actors(self, data: st.DataObject, first: str) -> None:
        """A round's view made stale by a migration, then its job's attempt pruned from the
        cold tier while its commit waits for marks. First a checkpoint left pending (a
        killed run's) and a newer one committed in cold: something for the prune to take."""
        machine: Any = self
        for migrate in (False, True):
            setup = machine.actor("save", data, migrate=migrate)
            machine.check(setup, forking.run(setup.fn, world=setup.world), faulted=False)
        self._threads_go_on = True
        try:
            self.force_twice(data, "deliver", first, "migrate", "migrator.before_marks_listing", "prune-cold")
        finally:
            self._threads_go_on = False

    def force_twice(self, data: st.DataObject, a: str, first: str, b1: str, second: str, b2: str) -> None:
        """A held at ``first`` while ``b1`` runs to its end, then at ``second`` while ``b2``
        does, then released (a gate A passes by, or gets to out of order, is skipped)."""
        machine: Any = self
        actor = machine.actor(a, data)
        machine.gate_n += 1
        gate = Gate(machine.root / f"gate-{machine.gate_n}")
        job = forking.start(actor.fn, world=actor.world, block=(first, second), env=gate.env)
        try:
            others = {first: b1, second: b2}
            points = [first, second]
            while points:
                point = _reached(gate, points, job.pids[0])
                if point is None:
                    break  # ended without reaching another gate
                points = points[points.index(point) + 1 :]
                other = others[point]
                machine.look()
                step_b = machine.actor(other, data, a_in_flight=a)
                outcome_b = forking.run(step_b.fn, world=step_b.world)
                machine.look()
                machine.check(step_b, outcome_b, faulted=False)
                gate.release(point)
                STATS.crash_points.add(point)
            gate.release_all()
            outcome = job.wait(120)
        except BaseException:
            job.kill()
            job.wait(10)
            raise
        STATS.steps += 1
        machine.check(actor, outcome, faulted=False)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def nothing_delivered_and_pruned_from_cold_comes_back(self) -> None:
        """An attempt that left the cold tier while the hot tier recorded it delivered there
        (its migrated mark) is never committed there again. (One whose mark a crash lost
        before the cold prune is pending again by design: invariant 12.)"""
        machine: Any = self
        hot, cold = machine.tier("hot"), machine.tier("cold")
        now = {(m.name, m.attempt) for m in cold.manifests()}
        gone: set[tuple[str, str]] = getattr(self, "_delivered_gone", set())
        back = gone & now
        assert not back, f"delivered, pruned from the cold tier, then committed there again: {sorted(back)}"
        cold_id = marks.store_id(cold)
        newly = (machine.ever_cold - now) - gone
        if cold_id is not None:
            gone |= {a for a in newly if hot.backend.exists(layout.migrated_key(a[0], a[1], cold_id))}
        self._delivered_gone = gone


def _reached(gate: Gate, points: list[str], pid: int, timeout: float = 60.0) -> str | None:
    """The first of ``points`` the held actor reaches, or ``None`` once it has ended."""
    deadline = time.monotonic() + timeout
    while True:
        for point in points:
            if gate.reached(point):
                return point
        if forking_exited(pid):
            return None
        if time.monotonic() > deadline:
            raise AssertionError(f"the held actor reached none of {points} within {timeout:.0f}s")
        time.sleep(0.002)
