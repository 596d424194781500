"""Copies on other nodes (issue 37) as a state machine: two "nodes" of one rank each
(``Topology(world=2, local_world=1)``), each with a node-local hot root of its own
(``Store(hot_i, cold, node_local=True)``), one local cold directory, ``Replicas(2)``. Every
actor is a real forked operation (``forking.py``; a two-rank one is two children in a gloo
group, ``Peers`` built on that default group, ``group=None``):

* **save**: a two-rank DCP save through ``TieredWriter`` of step ``s``, migrated to cold by
  the writers' migrators or not (then pending), and mostly its protect round in the same
  operation (rank 0 reads the manifest from its hot tier, rank 1 passes ``None``);
* **protect**: one ``Peers.protect`` round of a checkpoint node 0 committed (the newest most
  often, an older one sometimes: a round that runs late);
* **migrate**: node-local migration without a manager, one checkpoint a run (rank 0 finds it
  pending and commits it; each rank uploads its own files, as the manager's start does);
* **prune**: ``prune_node_local(hot_i, cold, keep_last(1), peers=peer_tier(hot_i))`` on one
  node or on both at once (each rank its own node, as after every save);
* **gc**: ``collect_garbage(hot_i, dry_run=False)`` of one node's hot root;
* **restore**: two-rank ``Peers.restore()``, what a relaunch runs first;

and the machine's own faults, rules of their own: **a node lost** (its hot directory wiped,
``rmtree`` + ``mkdir``) and **a disk error** (one bit flipped in a file on one node's disk: its
own, or a copy it keeps).

**A gate between every check and its act.** A rule ``<actor>_held`` forces one interleaving
(gates.py): actor A is forked and every rank of it that passes the drawn fault point is held
there (so B meets the same state whatever the scheduler did); actor B runs to its end; then
A is released, SIGKILLed (the whole job: power lost), or one rank of it is SIGKILLed and the
other released (a node lost in the middle of a round). A is held: a round before its
transfers, after its n-th file (``peers.flow_done``, n drawn), after its transfers, before
its publish; a restore before its transfers and after its n-th file; a prune after its
listing, before and after its un-publish, after its lease check, after its file deletes,
before un-publishing the copies' manifest (``peers.before_drop_unpublish``) and before
deleting the copies (``peers.before_drop_files``); GC after its scan; a save after a shard
and before its commit; a migration after its cold check and before its cold commit. Before A
starts, the machine makes sure it has something to act on (a checkpoint to protect, one
pending, two committed in cold for a prune to drop one, maybe a lost node for a restore).
Not reached: ``peers.before_unpublish_stale`` (no name is committed twice here).

**What runs beside what.** B is what the same job or a person could run while A is held: a
save beside a round (the manager's rounds run on a thread of their own while training saves
again), prunes and GC beside anything, a migration beside anything but a restore; never two
rounds at once (the manager runs one at a time). While a node is lost (wiped, not restored
since), only restores, prunes and GC run (a relaunch restores before it saves).

**Around the product bugs it found and that are not fixed** (each replayed as an
``xfail(strict=True)`` test in test_copies_machine.py), so that it goes on looking for
others: a prune beside a round never drops the round's checkpoint, a round beside a prune
never protects one the prune drops, and a restore and a prune never run at once
(:data:`ROUND_AND_PRUNE`). The two it found that are fixed (a prune killed between deleting
its node's files and un-publishing that node's protection; GC held after its scan while a
round or a restore publishes what it scanned) it no longer steers around: it runs them.

**GC's grace** is what protects a round in flight (its copies are no manifest's until it
publishes), a save in flight (files before the manifest), a restore and a migration in
flight; and on node 1, which never holds the hot manifests, a checkpoint neither committed in
cold nor protected there is named by nothing GC can see from that root: the grace alone keeps
its shards (the design: "the grace period protects attempts still being written and
migrations in flight"). So GC runs with ``grace=0`` only when no save, round, restore or
migration is held beside it and no file of a checkpoint cold has not committed has its last
verified copy where GC, from that node's root, sees no manifest naming it (that root's hot
manifests name its own files; its replica namespace's name its own files and its copies);
otherwise with an hour (nothing here is that old: GC deletes nothing, but runs). GC held
after its scan while a round or a restore runs beside it keeps a grace of 0: the grace cannot
protect copies older than it that a restore publishes again, so GC must look at the replica
namespace again before it deletes (it does: ``gc._still_unpublished``).

**A disk error** flips one bit of a file of a checkpoint on one node: of a checkpoint no node
publishes as protected (a round must then refuse to copy it), or, in a protected one, only
where another verified copy of that file is on the other node (one fault: ``Replicas(2)``
must survive it). The machine remembers the bytes it left: a file holding exactly them is the
machine's damage (excused in invariant 1: a restore checks sizes, not bytes, of what a node
still holds, by design); anything else a node holds, which a round or a restore wrote, must
verify. A checkpoint of which the machine's faults alone (disk errors, lost nodes) left some
file with no verified copy on any node is *spoiled*: never required by invariant 2 again.

Invariants, after every step (direct reads of both nodes' disks, every byte's CRC32C), in
this order (one ``copies_invariants``: a bug that breaks several is named by the first):

1. **Trusted is complete.** For every manifest published in a node's replica namespace, its
   protection record exists, and every file the record says that node holds (each rank's it
   lists the node for: its own rank's files and the ``.metadata`` it wrote on its hot tier,
   the other rank's files and ``.metadata`` in its namespace) is there and matches the
   manifest's CRC32C, unless it holds the machine's damaged bytes. And every checkpoint
   node 0's hot tier commits has node 0's files there, intact (unless spoiled).
3. **The last verified copy of a checkpoint the cold tier has not committed is never
   deleted** (by a prune, GC, drop_copies, anything): every file of a checkpoint node 0's hot
   tier ever committed or a node ever protected, cold not having committed it, that had a
   verified copy on some node at the previous step still has one (the machine's own faults
   excused: their rules take the new view as the baseline).
2. **Nothing protected is lost.** Every checkpoint ever published as protected on a node
   stays published on some node, and every one of its files (``.metadata`` too) has a
   verified copy on the nodes' disks as they are now (loadable with the cold tier gone),
   unless a prune's plan dropped it (planned from the cold listing: only what cold committed,
   all but the newest) or it is spoiled. **Once a node is lost** (the weaker form), only the
   checkpoints the survivor publishes stay required, and the survivor alone must hold every
   file of each (Replicas(2) over two nodes: it holds both ranks' files); one published only
   on the lost node (a round killed between the two nodes' publishes) is excused.
4. **After a restore that returned** (every rank), every checkpoint invariant 2 requires is
   published on both nodes again, and each node holds its files and the copies Replicas(2)
   puts there, verified (a lost node is alive again from then on).

And what the actors promised: a round that returned two copies left its checkpoint published
on both nodes (unless a prune's plan dropped it); an operation not killed raised nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import forking
import model
import torch.distributed as dist
from gates import Gate, exited
from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from stats import STATS

from tierstore import TieredWriter
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest, checkpoint_order
from tierstore.lifecycle import prune as prune_mod
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import check_cold_copies, plan_prune
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.migrator import Migrator
from tierstore.redundancy import Replicas, Topology
from tierstore.redundancy.protect import Peers
from tierstore.redundancy.records import peer_tier, read_record
from tierstore.storage import faults
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers.tier import Store, Tier

__all__ = ["CopiesMachine", "POINTS", "BESIDE"]

SCHEME = Replicas(2)
TOPOLOGY = Topology(world=2, local_world=1)
NODES = (0, 1)
# A commit waits this long for a rank's upload mark that never comes: short, or one wrong
# wait costs the budget.
CONFIG = replace(model.FAST, commit_timeout=3)
HOUR = 3600.0
BOTH = (0, 1)

# Where each actor may be held, and which of its ranks pass there (each of them is held:
# the state B meets is then the same whatever the scheduler did). ``peers.flow_done`` is
# held at its n-th pass (n drawn): after the n-th file of the round or the restore.
POINTS: dict[str, dict[str, tuple[int, ...]]] = {
    "save": {"writer.after_file_write": BOTH, "writer.before_manifest_publish": (0,)},
    "protect": {
        "peers.before_transfer": BOTH,
        "peers.flow_done": BOTH,
        "peers.after_transfer": BOTH,
        "peers.before_publish": BOTH,
    },
    "migrate": {"migrator.after_cold_check": (0,), "migrator.before_cold_publish": (0,)},
    "prune": {
        "prune.after_listing": BOTH,
        "prune.before_unpublish": BOTH,
        "prune.after_unpublish": BOTH,
        "prune.after_lease_check": BOTH,
        "prune.after_file_delete": BOTH,
        "peers.before_drop_unpublish": BOTH,
        "peers.before_drop_files": BOTH,
    },
    "gc": {"gc.after_scan": BOTH},
    "restore": {"peers.before_restore_transfer": BOTH, "peers.flow_done": BOTH},
}
# What may run while A is held (module docstring).
BESIDE: dict[str, tuple[str, ...]] = {
    "save": ("protect", "migrate", "prune", "gc"),
    "protect": ("save", "migrate", "prune", "gc"),
    "migrate": ("save", "protect", "prune", "gc"),
    "prune": ("save", "protect", "migrate", "prune", "gc"),
    "gc": ("save", "protect", "migrate", "prune", "restore"),
    "restore": ("gc",),
}
# While a node is lost: the relaunch's restore, and what a person may run on a node.
WHILE_LOST = ("restore", "prune", "gc")
# Actors that write what no manifest names yet while they run (GC's grace protects them).
WRITERS = ("save", "protect", "migrate", "restore")
FINISH = ("release", "release", "kill", "kill-rank")
# Product bugs this machine found and that are not fixed, each reproduced by an xfail test in
# test_copies_machine.py; the machine steers around them so that it goes on finding others.
# A round (or a restore) and a prune of one checkpoint at once, either held while the other
# runs: the round publishes a protection whose files the prune deleted, or the prune deletes
# the files of a protection published after it decided (test_a_round_and_a_prune_of_one_checkpoint,
# test_a_restore_and_a_prune_of_one_checkpoint). Never paired here: a prune beside a round
# never drops the round's checkpoint, a round beside a prune never protects one it drops, and
# a restore (which republishes every protected checkpoint) and a prune never run at once.
ROUND_AND_PRUNE = ("protect", "prune")


@dataclass
class Op:
    """One actor's run as the machine planned it: ``fn(rank)`` on ``world`` ranks, the nodes
    it acts on (rank ``i`` acts on node ``nodes[i]``)."""

    kind: str
    fn: Callable[[int], Any]
    nodes: tuple[int, ...] = BOTH
    step: int | None = None
    name: str | None = None
    protects: bool = False
    grace: float | None = None
    doomed: set[str] = field(default_factory=set)  # a prune's plan: the names it drops

    @property
    def world(self) -> int:
        return len(self.nodes)


Key = tuple[str, str]  # (checkpoint name, attempt)
Loc = tuple[int, str]  # (node, "hot" | "peer")


def note(text: str) -> None:
    """Say it in a failing example's report (nothing outside a hypothesis run: a test that
    drives the machine step by step)."""
    try:
        _note(text)
    except InvalidArgument:
        pass


def _held_rule(a: str) -> Any:
    """A rule holding actor ``a`` (one rule per actor: hypothesis picks rules evenly)."""

    @rule(data=st.data(), pick=st.integers(0, 1 << 16))
    def held(self: CopiesMachine, data: st.DataObject, pick: int) -> None:
        self.held(a, data, pick)

    held.__name__ = held.__qualname__ = f"{a}_held"
    return held


class CopiesMachine(RuleBasedStateMachine):
    """Two nodes, one rank each, ``Replicas(2)``: the actors and invariants of the module
    docstring. A machine derived for one purpose (a catch of test_catches_copies.py) sets
    rules it does not want to ``None``."""

    steer = True  # around the product bugs it found that are not fixed (ROUND_AND_PRUNE)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierstore-copies-"))
        self.hots = tuple(str(self.root / f"node{n}") for n in NODES)
        self.cold = str(self.root / "cold")
        for path in (*self.hots, self.cold):
            os.makedirs(path)
        self.next_step = 1
        self.lost: int | None = None  # a node wiped and not restored since
        self.required: dict[Key, Manifest] = {}  # invariant 2's checkpoints
        self.dropped: set[Key] = set()  # a prune's plan dropped them
        self.spoiled: set[Key] = set()  # the machine's faults alone left a file with no copy
        self.committed_hot: dict[Key, Manifest] = {}  # ever committed in node 0's hot tier
        self.damaged: dict[tuple[int, str], int] = {}  # (node, key) -> CRC32C the machine left
        self.last_copies: dict[tuple[Key, str], set[Loc]] = {}  # invariant 3's previous view
        self.broken: list[str] = []  # promises actors broke (raised by an invariant)
        self.gate_n = 0
        STATS.examples += 1

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the nodes as the checker sees them (fresh tiers: nothing cached) ------------------

    def hot(self, node: int) -> Tier:
        return Tier("hot", self.hots[node])

    def peers(self, node: int) -> Tier:
        return peer_tier(self.hot(node))

    def alive(self) -> tuple[int, ...]:
        return tuple(n for n in NODES if n != self.lost)

    def path(self, node: int, where: str, key: Key, file: str) -> Path:
        base = Path(self.hots[node]) / (layout.REPLICA_DIR if where == "peer" else "")
        return base / layout.file_key(key[0], key[1], file)

    def verified(self, node: int, where: str, key: Key, entry: FileEntry, *, excuse: bool = False) -> bool:
        """Whether ``node`` holds ``entry`` intact there (every byte read); ``excuse``: or
        holds exactly the bytes the machine damaged it into (a disk error)."""
        path = self.path(node, where, key, entry.path)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            self.damaged.pop((node, str(path)), None)
            return False
        crc = crc32c_update(0, data)
        if len(data) == entry.size and crc == entry.crc32c:
            self.damaged.pop((node, str(path)), None)
            return True
        return excuse and self.damaged.get((node, str(path))) == crc

    def not_held(self, node: int, key: Key, entries: Sequence[FileEntry]) -> str:
        """Which of ``entries`` ``node`` lacks where Replicas(2) keeps them: "missing: [...]",
        "damaged: [...]" (bytes that are not the manifest's, nor the machine's damage)."""
        missing, damaged = [], []
        for entry in entries:
            where = self.home(node, entry)
            if not self.verified(node, where, key, entry, excuse=True):
                exists = self.path(node, where, key, entry.path).exists()
                (damaged if exists else missing).append(f"{where}:{entry.path}")
        return "; ".join(
            f"{what}: {files}" for what, files in (("missing", missing), ("damaged", damaged)) if files
        )

    def published(self, node: int) -> dict[Key, Manifest]:
        return {(m.name, m.attempt): m for m in self.peers(node).manifests()}

    def in_cold(self) -> dict[Key, Manifest]:
        return {(m.name, m.attempt): m for m in Tier("cold", self.cold).manifests()}

    def locations(self, key: Key, entry: FileEntry) -> set[Loc]:
        """Where the nodes hold ``entry`` of ``key`` intact now."""
        return {(n, where) for n in NODES for where in ("hot", "peer") if self.verified(n, where, key, entry)}

    def home(self, node: int, entry: FileEntry) -> str:
        """Where Replicas(2) keeps ``entry`` on ``node``: its own rank's files (and the
        ``.metadata`` its rank wrote) on the hot tier, the other rank's in the namespace."""
        return "hot" if TOPOLOGY.node_of(entry.rank) == node else "peer"

    def look(self) -> None:
        """Remember what is committed in node 0's hot tier and protected anywhere now."""
        self.committed_hot.update({(m.name, m.attempt): m for m in self.hot(0).manifests()})
        for node in self.alive():
            for key, manifest in self.published(node).items():
                if key not in self.dropped and key not in self.spoiled:
                    self.required.setdefault(key, manifest)

    def live(self) -> dict[Key, Manifest]:
        """Checkpoints whose last copies must never go (invariant 3): committed in node 0's
        hot tier or protected, the cold tier not having committed them."""
        cold = self.in_cold()
        found = {**self.committed_hot, **self.required}
        for node in self.alive():
            found.update(self.published(node))
        return {k: m for k, m in found.items() if k not in cold}

    def copies_now(self) -> dict[tuple[Key, str], set[Loc]]:
        return {
            (key, entry.path): self.locations(key, entry)
            for key, manifest in self.live().items()
            for entry in manifest.files
        }

    # -- planning actors ---------------------------------------------------------------------

    def _save(self, step: int, migrate: bool, protects: bool) -> Op:
        """A two-rank save of ``step`` (its writers migrating it, or not), its round after it."""
        hots, cold = self.hots, self.cold

        def save(rank: int) -> Any:
            store = Store(hots[rank], cold, node_local=True) if migrate else Store.of(hots[rank], None)
            writer = TieredWriter(store, step=step, migration=CONFIG)
            states = model.save_and_migrate(writer, step, "sync", 60)
            return states, (_protect(hots, cold, rank, step) if protects else None)

        return Op("save", save, step=step, name=layout.default_name(step), protects=protects)

    def plan(
        self,
        kind: str,
        data: st.DataObject,
        *,
        beside: str | None = None,
        migrate: bool | None = None,
        target: str | None = None,
        avoid: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> Op:
        """Actor ``kind``, planned now (``beside``: the actor held while it runs)."""
        hots, cold = self.hots, self.cold
        if kind == "save":
            step, self.next_step = self.next_step, self.next_step + 1
            if migrate is None:
                migrate = data.draw(st.booleans(), label="the writer migrates")
            protects = data.draw(st.sampled_from([True, True, False]), label="its round follows")
            if beside == "protect":
                protects = False  # one round at a time: the held one is the manager's
            return self._save(step, migrate, protects)
        if kind == "protect":
            names = sorted(m.name for m in self.hot(0).manifests() if m.name not in avoid)
            if not names:
                return Op("protect", lambda rank: None)
            # The newest most often (the round after a save), an older one sometimes.
            name = (
                target
                if target is not None and target not in avoid
                else data.draw(
                    st.sampled_from(names[::-1]) if len(names) > 1 else st.just(names[0]), label="protect"
                )
            )
            step = int(name.rsplit("-", 1)[1])
            return Op("protect", lambda rank: _protect(hots, cold, rank, step), step=step, name=name)
        if kind == "migrate":
            # One checkpoint a run (`tierstore migrate --name`): the oldest pending whose
            # ranks hold their files intact (else an upload fails, and the commit waits out
            # commit_timeout for a mark that never comes, losing nothing). One commit, so the
            # one held at a gate is the only one: none goes on beside B, unseen by its plan.
            cold_names = {m.name for m in self.in_cold().values()}
            pending = sorted(
                (
                    m
                    for m in self.hot(0).manifests()
                    if m.name not in cold_names and self.whole_at_home((m.name, m.attempt), m)
                ),
                key=checkpoint_order,
            )
            wanted = {pending[0].name} if pending else set()

            def migrate(rank: int) -> Any:
                return _migrate(hots, cold, rank, wanted)

            return Op("migrate", migrate)
        if kind == "prune":
            nodes = data.draw(st.sampled_from([(0,), (1,), BOTH]), label="prune nodes")
            nodes = tuple(n for n in nodes if n in self.alive()) or self.alive()
            # Its plan, from the cold listing as the prune is about to list it (nothing runs
            # between here and its listing): what cold committed, all but the newest.
            doomed = plan_prune(Tier("cold", cold).manifests(), keep_last(1), now=time.time())[0]
            for manifest in doomed:
                key = (manifest.name, manifest.attempt)
                self.dropped.add(key)
                self.required.pop(key, None)
            dropping = {m.name for m in doomed}

            def prune(rank: int) -> Any:
                store = Store(hots[nodes[rank]], cold, node_local=True)
                assert store.hot is not None and store.cold is not None
                report = prune_mod.prune_node_local(
                    store.hot, store.cold, keep_last(1), peers=peer_tier(store.hot)
                )
                return list(report.deleted), list(report.errors)

            return Op("prune", prune, nodes=nodes, doomed=dropping)
        if kind == "gc":
            node = data.draw(st.sampled_from(self.alive()), label="gc node")
            grace = 0.0 if beside not in WRITERS and self.gc_may_delete_young(node) else HOUR

            def gc(rank: int) -> Any:
                report = collect_garbage(hots[node], grace=grace, dry_run=False)
                return len(report.garbage), [f.error for f in report.failures]

            return Op("gc", gc, nodes=(node,), grace=grace)
        assert kind == "restore", kind

        def restore(rank: int) -> Any:
            return [(p.name, p.copies, p.errors) for p in _peers(hots, cold, rank).restore()]

        return Op("restore", restore)

    def prune_drops(self) -> set[str]:
        """What a prune that lists the cold tier now drops (keep_last(1): all but the newest)."""
        return {
            m.name for m in plan_prune(Tier("cold", self.cold).manifests(), keep_last(1), now=time.time())[0]
        }

    def whole_at_home(self, key: Key, manifest: Manifest) -> bool:
        """Whether each rank's node holds that rank's files of ``key`` intact (hot tier)."""
        return all(self.verified(TOPOLOGY.node_of(e.rank), "hot", key, e) for e in manifest.files)

    def gc_may_delete_young(self, node: int) -> bool:
        """Whether GC of ``node`` with a grace of 0 would delete nothing the machine needs:
        no last verified copy of a checkpoint cold has not committed lies where, from that
        node's root, no manifest names it (module docstring)."""
        named_hot = {(m.name, m.attempt) for m in self.hot(node).manifests()}
        named_peer = set(self.published(node))
        for (key, _file), locs in self.copies_now().items():
            if not locs or any(n != node for n, _ in locs):
                continue  # no copy to lose, or one on the other node
            kept = {where for _, where in locs if key in named_peer or (where == "hot" and key in named_hot)}
            if not kept:
                return False
        return True

    # -- running them --------------------------------------------------------------------

    def run_alone(self, op: Op) -> None:
        outcome = forking.run(_joined(op.fn, op.world), world=op.world, timeout=120)
        STATS.steps += 1
        self.look()
        note(f"{op.kind} {op.name or ''} {op.nodes}: {outcome.results}")
        self.check(op, outcome)

    def prepare(self, a: str, data: st.DataObject) -> None:
        """Make sure A has something to act on, so it reaches where it is held: a checkpoint
        to protect, one pending in cold to migrate, two committed in cold for a prune to drop
        one, something lost for a restore to send (a node, or a round's last publish)."""
        if self.lost is not None:
            return
        hot = {(m.name, m.attempt) for m in self.hot(0).manifests()}
        cold = self.in_cold()
        if a == "protect" and not hot - (set(self.published(0)) & set(self.published(1))):
            self.run_alone(self.plan("save", data, beside="protect"))
        elif a == "migrate" and not hot - set(cold):
            self.run_alone(self.plan("save", data, migrate=False))
        elif a == "prune" and len(cold) < 2:
            for _ in range(2 - len(cold)):
                self.run_alone(self.plan("save", data, migrate=True))
        elif a == "restore" and self.published_anywhere() and data.draw(st.booleans(), label="lose first"):
            self.lose_a_node(data.draw(st.sampled_from(NODES), label="the node lost"))

    def force(
        self, data: st.DataObject, a: str, point: str, b: str, finish: str, *, target: str | None = None
    ) -> None:
        """A held at ``point`` (every rank of it that passes there), B run to its end, then
        A released, killed, or one rank of it killed and the other released; ``target``: the
        checkpoint a round protects (A's or B's)."""
        if target is None:
            self.prepare(a, data)
        first = self.plan(a, data, target=target)
        hit = data.draw(st.integers(1, 3), label="its pass") if point == "peers.flow_done" else 1
        holders = [r for r in POINTS[a][point] if r < first.world]
        self.gate_n += 1
        gate = Gate(self.root / "gates" / str(self.gate_n))

        def held(rank: int) -> Any:
            if rank in holders:
                faults.arm(point, "block", hit=hit)
            return first.fn(rank)

        job = forking.start(_joined(held, first.world), world=first.world, env=gate.env)
        try:
            reached = _wait_held(gate, point, [job.pids[r] for r in holders])
            self.look()
            avoid: set[str] = set()
            if self.steer and reached:  # around the known bugs (ROUND_AND_PRUNE)
                if b == "prune" and a == "protect" and first.name in self.prune_drops():
                    b = "gc"
                avoid = first.doomed
            second = self.plan(b, data, beside=a if reached else None, target=target, avoid=avoid)
            outcome_b = forking.run(_joined(second.fn, second.world), world=second.world, timeout=120)
            self.look()
            self.check(second, outcome_b)
            if reached and finish == "kill":
                job.kill()
                STATS.faults += 1
            elif reached and finish == "kill-rank" and first.world > 1:
                victim = data.draw(st.sampled_from(range(first.world)), label="the rank killed")
                os.kill(job.pids[victim], 9)
                STATS.faults += 1
            gate.release(point)
            outcome_a = job.wait(120)
        except BaseException:
            job.kill()
            job.wait(10)
            raise
        STATS.steps += 1
        if reached:
            STATS.crash_points.add(point)
        self.look()
        note(
            f"{a} held at {point}{f' (pass {hit})' if hit > 1 else ''}"
            f"{'' if reached else ' (never reached)'}; {b} {second.nodes} ran: {outcome_b.results}; "
            f"{a} {finish if reached else 'ended'}: {outcome_a.results}"
        )
        if os.environ.get("TIERSTORE_COPIES_TRACE"):
            with open(os.environ["TIERSTORE_COPIES_TRACE"], "a") as trace:
                print(a, point, hit, reached, b, finish, outcome_a.results, outcome_b.results, file=trace)
        self.check(first, outcome_a)

    # -- what each promised -------------------------------------------------------------------

    def promise(self, kept: bool, broken: str) -> None:
        if not kept:
            self.broken.append(broken)

    def check(self, op: Op, outcome: forking.Outcome) -> None:
        if outcome.killed:
            return  # the whole job, or one rank of it and its peer failing with it
        if not outcome.ok:
            self.promise(False, f"{op.kind} failed: {outcome.errors} (exit codes {outcome.exitcodes})")
            return
        if op.kind in ("save", "protect") and (op.kind == "protect" or op.protects):
            result = outcome.results[0] if op.kind == "protect" else outcome.results[0][1]
            if result is not None and result[0] == 2:
                key = next((k for k in self.published_anywhere() if k[0] == op.name), None)
                on = [n for n in self.alive() if key is not None and key in self.published(n)]
                dropped = any(k[0] == op.name for k in self.dropped)
                self.promise(
                    dropped or on == list(NODES),
                    f"a round of {op.name} returned 2 copies, published on nodes {on}",
                )
        if op.kind == "restore":
            self.check_restored()

    def published_anywhere(self) -> set[Key]:
        return {k for n in self.alive() for k in self.published(n)}

    def check_restored(self) -> None:
        """Invariant 4: both nodes hold every required checkpoint again, published."""
        self.lost = None
        for key, manifest in sorted(self.required.items()):
            for node in NODES:
                self.promise(
                    key in self.published(node),
                    f"after a restore, {key[0]} ({key[1]}) is not protected on node {node}",
                )
                bad = self.not_held(node, key, manifest.files)
                self.promise(not bad, f"after a restore, node {node} holds {key[0]} ({key[1]}) but {bad}")

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: self.lost is None)
    @rule(data=st.data())
    def save_alone(self, data: st.DataObject) -> None:
        self.run_alone(self.plan("save", data))

    def held(self, a: str, data: st.DataObject, pick: int) -> None:
        """A held at a point; B runs to its end; A released, killed, or one rank of it
        (``pick`` chooses the point, B and the finish: hypothesis draws integers evenly)."""
        if self.lost is not None and a not in WHILE_LOST:
            return
        beside = [b for b in BESIDE[a] if self.lost is None or b in WHILE_LOST]
        points = sorted(POINTS[a])
        point = points[pick % len(points)]
        b = beside[(pick >> 4) % len(beside)]
        finish = FINISH[(pick >> 8) % len(FINISH)]
        self.force(data, a, point, b, finish)

    protect_held = _held_rule("protect")
    restore_held = _held_rule("restore")
    prune_held = _held_rule("prune")
    save_held = _held_rule("save")
    migrate_held = _held_rule("migrate")
    gc_held = _held_rule("gc")

    @rule(data=st.data())
    def restore_alone(self, data: st.DataObject) -> None:
        self.run_alone(self.plan("restore", data))

    @precondition(lambda self: self.lost is None)
    @rule(data=st.data())
    def protect_alone(self, data: st.DataObject) -> None:
        """A round of a checkpoint node 0 committed (the newest most often)."""
        self.run_alone(self.plan("protect", data))

    @precondition(lambda self: self.lost is None)
    @rule(node=st.sampled_from(NODES))
    def lose_a_node(self, node: int) -> None:
        """A node replaced: its hot directory wiped. Invariant 2 keeps required what the
        survivor publishes; what the machine's faults alone left without a verified copy of
        some file is spoiled (module docstring)."""
        survivor = 1 - node
        self.look()
        known = {**self.committed_hot, **self.required}
        shutil.rmtree(self.hots[node])
        os.makedirs(self.hots[node])
        self.damaged = {k: v for k, v in self.damaged.items() if k[0] != node}
        self.lost = node
        note(f"node {node} lost")
        STATS.faults += 1
        published = self.published(survivor)
        for key, manifest in sorted(known.items()):
            if any(not self.locations(key, e) for e in manifest.files):
                self.spoiled.add(key)
            if key in self.spoiled or key not in published:
                self.required.pop(key, None)
        self.last_copies = self.copies_now()

    @rule(node=st.sampled_from(NODES), where=st.sampled_from(["hot", "peer"]), pick=st.integers(0, 1 << 16))
    def a_disk_flips_a_bit(self, node: int, where: str, pick: int) -> None:
        """A disk error in a file on one node (module docstring for where it may be)."""
        if node == self.lost:
            return
        protected = self.published_anywhere()
        candidates = []
        for key, manifest in sorted(self.committed_hot.items()):
            for entry in manifest.files:
                if entry.size == 0:
                    continue
                if not self.verified(node, where, key, entry):
                    continue
                others = {loc for loc in self.locations(key, entry) if loc[0] != node}
                if (key in protected or key in self.required) and not others:
                    continue  # the only copy of a protected file: two faults
                candidates.append((key, entry))
        if not candidates:
            return
        key, entry = candidates[pick % len(candidates)]
        path = self.path(node, where, key, entry.path)
        data = bytearray(path.read_bytes())
        data[pick % len(data)] ^= 1 << (pick % 8)
        path.write_bytes(bytes(data))
        self.damaged[(node, str(path))] = crc32c_update(0, bytes(data))
        note(f"a bit of {path.relative_to(self.root)} flipped")
        STATS.faults += 1
        if not self.locations(key, entry):
            self.spoiled.add(key)  # an unprotected checkpoint's only copy: the machine's loss
            self.required.pop(key, None)
        self.last_copies = self.copies_now()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def copies_invariants(self) -> None:
        """Invariants 1, 3 and 2, then the actors' promises (4 among them), in that order: a
        bug that breaks several is named by the first (a damaged copy a round kept also
        destroys the last good one; a protected checkpoint deleted is also no longer
        published), as the catches of test_catches_copies.py expect."""
        self.trusted_is_complete()
        self.last_copies_of_what_cold_lacks_are_kept()
        self.nothing_protected_is_lost()
        self.actors_kept_their_promises()

    def actors_kept_their_promises(self) -> None:
        broken, self.broken = self.broken, []
        assert not broken, broken[0]

    def trusted_is_complete(self) -> None:
        """Invariant 1 (module docstring)."""
        for node in self.alive():
            peers = self.peers(node)
            for key, manifest in sorted(self.published(node).items()):
                record = read_record(peers, manifest)
                assert record is not None, f"node {node} publishes {key[0]} ({key[1]}) without its record"
                held = [r for r, nodes in record.holders.items() if node in nodes]
                claimed = [e for e in manifest.files if e.rank in held]
                if key in self.spoiled:
                    # A record counts each rank's data files, not .metadata (a restore's
                    # too: test_a_restore_counts_a_rank_whose_metadata_it_could_not_restore):
                    # once the machine's faults left no good .metadata, it may lack it.
                    meta = manifest.metadata_file
                    claimed = [
                        e
                        for e in claimed
                        if e.path != meta or self.path(node, self.home(node, e), key, meta).exists()
                    ]
                bad = self.not_held(node, key, claimed)
                assert not bad, (
                    f"node {node} publishes {key[0]} ({key[1]}) protected; its record says it holds "
                    f"ranks {held}; {bad}"
                )
        if 0 in self.alive():
            for manifest in self.hot(0).manifests():
                key = (manifest.name, manifest.attempt)
                if key in self.spoiled:
                    continue
                bad = self.not_held(0, key, manifest.files_of_rank(0))
                assert not bad, f"node 0's hot tier commits {key[0]} ({key[1]}); {bad}"

    def nothing_protected_is_lost(self) -> None:
        """Invariant 2 (module docstring)."""
        self.look()
        anywhere = self.published_anywhere()
        for key, manifest in sorted(self.required.items()):
            assert key in anywhere, f"{key[0]} ({key[1]}) was protected; no node publishes it now"
            lost = [e.path for e in manifest.files if not self.locations(key, e)]
            assert not lost, f"{key[0]} ({key[1]}) is protected; no node holds a verified copy of {lost}"

    def last_copies_of_what_cold_lacks_are_kept(self) -> None:
        """Invariant 3 (module docstring)."""
        now = self.copies_now()
        cold = self.in_cold()
        gone = sorted(
            f"{key[0]} ({key[1]}) {file}: was on {sorted(locs)}"
            for (key, file), locs in self.last_copies.items()
            if locs and not now.get((key, file)) and key not in cold
        )
        self.last_copies = now
        assert not gone, f"the last verified copy of a checkpoint cold has not committed was deleted: {gone}"


# -- the operations, run in the forked ranks ----------------------------------------------------


def _joined(fn: Callable[[int], Any], world: int) -> Callable[[int], Any]:
    """``fn`` once every rank joined the group: a rank done at once must not leave (closing
    its connections) while another is still connecting (gloo's connectFullMesh fails)."""
    if world == 1:
        return fn

    def joined(rank: int) -> Any:
        dist.barrier()
        return fn(rank)

    return joined


def _peers(hots: tuple[str, ...], cold: str, rank: int) -> Peers:
    hot = Store(hots[rank], cold, node_local=True).hot
    assert hot is not None
    return Peers(SCHEME, TOPOLOGY, None, rank, hot, peer_tier(hot))


def _protect(hots: tuple[str, ...], cold: str, rank: int, step: int) -> tuple[int, list[str]] | None:
    """One round for ``step``: rank 0 reads the manifest from its hot tier, rank 1 passes None."""
    peers = _peers(hots, cold, rank)
    manifest = peers.hot.find_manifest(layout.default_name(step)) if rank == 0 else None
    done = peers.protect(manifest)
    return None if done is None else (done.copies, done.errors)


def _migrate(hots: tuple[str, ...], cold: str, rank: int, wanted: set[str]) -> list[Any]:
    """Node-local migration without a manager: rank 0 finds the checkpoints pending in cold
    (its node holds the hot manifests) and commits them; every rank uploads its own files."""
    store = Store(hots[rank], cold, node_local=True)
    hot, cold_tier = store.hot, store.cold
    assert hot is not None and cold_tier is not None
    box: list[Any] = [None]
    if rank == 0:
        pending = check_cold_copies(hot, cold_tier).pending
        box[0] = [m for m in sorted(hot.manifests(), key=checkpoint_order) if m.name in pending & wanted]
    dist.broadcast_object_list(box, src=0)
    migrator = Migrator(hot, cold_tier, CONFIG)
    try:
        for manifest in box[0]:
            if rank == 0:
                migrator.submit_commit(manifest, 0)
            else:
                migrator.submit_rank(
                    manifest.name, manifest.attempt, manifest.step, rank, manifest.files_of_rank(rank)
                )
        migrator.wait(60)
        return [(s.name, s.state.value, s.error) for s in migrator.status()]
    finally:
        migrator.close(1)


def _wait_held(gate: Gate, point: str, pids: list[int], timeout: float = 60.0) -> bool:
    """Wait until every one of ``pids`` is held at ``point`` or has ended; whether any is held."""
    deadline = time.monotonic() + timeout
    while True:
        reached = set(gate.reached(point))
        if all(pid in reached or exited(pid) for pid in pids):
            return bool(reached)
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks {pids} neither reached {point} nor ended in {timeout:.0f}s")
        time.sleep(0.002)
