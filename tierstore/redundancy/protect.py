"""Copies on other nodes: protecting a committed checkpoint, rebuilding a lost node from the
survivors, and fetching another node's file for a load (docs/design.md invariant 29).

Every function here is a collective of the checkpoint's process group: every rank calls it,
in the same order, and builds the same plan of flows (:mod:`tierstore.redundancy.wire`)
from what all ranks reported. Every byte that arrives is checked against the manifest's
size and CRC32C (a parity block against the record's) before it is kept; one that fails
is dropped, so a damaged, stale or planted copy is never used: the load then reads that
file from the cold tier, as it would without copies.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierstore import _dist
from tierstore.errors import ObjectNotFound, TierstoreError
from tierstore.format.manifest import FileEntry, Manifest, checkpoint_order
from tierstore.redundancy import codec, wire
from tierstore.redundancy.records import (
    FileSink,
    FileSource,
    Record,
    parity_path,
    read_record,
    write_record,
)
from tierstore.redundancy.schemes import Parity, Replicas, Scheme, Stripe, Topology
from tierstore.storage import faults
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers.tier import Tier

__all__ = ["Peers", "Protection"]

log = logging.getLogger(__name__)


@dataclass
class Protection:
    """What one round did on this rank: the checkpoint, its copies, and where bytes came from."""

    name: str
    attempt: str
    copies: int  # verified copies of the least protected rank (1: only its own)
    received: int = 0  # bytes this rank received
    seconds: float = 0.0  # the transfers' wall time on this rank (the collectives around them excluded)
    sources: dict[str, str] = field(default_factory=dict)  # file -> "hot" | "peer node N" | ...
    errors: list[str] = field(default_factory=list)


class Peers:
    """One manager's redundancy on one rank: ``scheme`` over ``topology``, collectives on
    ``group``, this node's ``hot`` tier and its replica namespace ``peers``."""

    def __init__(
        self, scheme: Scheme, topology: Topology, group: Any, rank: int, hot: Tier, peers: Tier
    ) -> None:
        scheme.check(topology)
        self.scheme, self.topology, self.group, self.rank = scheme, topology, group, rank
        self.hot, self.peers = hot, peers
        self.node = topology.node_of(rank)
        self.local = topology.local_of(rank)
        self.lead = self.local == 0  # writes this node's records and manifests

    # -- protecting a new checkpoint -------------------------------------------------------

    def protect(self, manifest: Manifest | None) -> Protection | None:
        """Send this rank's files to its peers and keep theirs, verified; publish the
        protection on every node once every copy verified. ``manifest`` is the coordinator's
        (the group's rank 0; ``None`` there: the save failed, nothing to protect); the
        others pass ``None``."""
        manifest = _dist.broadcast(manifest, self.group)
        if manifest is None:
            return None
        plan = _Plan(self, manifest)
        if isinstance(self.scheme, Replicas):
            plan.replicate()
        else:
            plan.encode_parity()
        plan.spread_metadata(have={self.topology.node_of(_meta(manifest).rank)})
        faults.point("peers.before_transfer")
        started = time.monotonic()
        received = wire.run(plan.flows, self.rank, self.group, ordered=plan.ordered)
        plan.finish()
        seconds = time.monotonic() - started
        faults.point("peers.after_transfer")
        report = plan.report()
        reports = _dist.all_gather(report, self.group)
        record = _record(self.scheme, self.topology, manifest, reports)
        done = Protection(
            manifest.name, manifest.attempt, record.copies, received, seconds, errors=report.errors
        )
        if record.copies > 1:
            if self.lead:
                faults.point("peers.before_publish")
                self._publish(manifest, record)
        else:
            log.warning(
                "checkpoint %s is not protected by copies on other nodes (%s); it depends on "
                "its own nodes and the cold tier",
                manifest.name,
                "; ".join(e for r in reports for e in r.errors) or "a copy failed",
            )
        _dist.barrier(self.group)  # every node published: "protected" is true everywhere
        return done

    def _publish(self, manifest: Manifest, record: Record) -> None:
        """Record, then publish, the protection on this node; a failure (a full disk) is
        logged, never raised: every rank must reach the round's last collective alike."""
        try:
            self._publish_here(manifest, record)
        except TierstoreError as err:
            log.error(
                "could not publish the protection of %s in %s: %s", manifest.name, self.peers.label, err
            )

    def _publish_here(self, manifest: Manifest, record: Record) -> None:
        write_record(self.peers, record)
        here = self.peers.find_manifest(manifest.name)
        if here is not None and here.attempt == manifest.attempt:
            return
        if here is not None:  # a stale attempt of the name: never the one a load reads
            faults.point("peers.before_unpublish_stale")
            self.peers.unpublish(here)
        self.peers.publish_manifest(manifest)

    # -- what this node holds --------------------------------------------------------------

    def protected(self) -> list[Manifest]:
        """The checkpoints protected on this node (its replica namespace's manifests)."""
        return self.peers.manifests()

    def _holds(self, tier: Tier, manifest: Manifest, entries: Sequence[FileEntry]) -> bool:
        for entry in entries:
            try:
                if (
                    tier.backend.stat(tier.file_key(manifest.name, manifest.attempt, entry.path)).size
                    != entry.size
                ):
                    return False
            except ObjectNotFound:
                return False
        return True

    # -- rebuilding a lost node ------------------------------------------------------------

    def restore(self) -> list[Protection]:
        """Bring every node back to what the protection records say it holds, from the
        surviving copies: run once at start, on every rank. A node replaced by an empty
        one gets its ranks' files, the copies it kept for others and the records back;
        the newest checkpoint first. Returns what each restored checkpoint took."""
        mine = self.protected() if self.lead else []
        known: dict[tuple[str, str], Manifest] = {}
        for found in _dist.all_gather(mine, self.group):
            for manifest in found:
                known.setdefault((manifest.name, manifest.attempt), manifest)
        newest: dict[str, Manifest] = {}
        for manifest in sorted(known.values(), key=checkpoint_order):
            newest[manifest.name] = manifest  # a name reused: its newest attempt
        done = []
        for manifest in sorted(newest.values(), key=checkpoint_order, reverse=True):
            try:
                done.append(self._restore_one(manifest))
            except wire.PeerLost:
                raise
            except TierstoreError as err:  # every rank alike (decided from gathered reports)
                log.error("could not restore the copies of %s from the other nodes: %s", manifest.name, err)
        return done

    def _restore_one(self, manifest: Manifest) -> Protection:
        record = read_record(self.peers, manifest) if self.lead else None
        records = [r for r in _dist.all_gather(record.to_json() if record else None, self.group) if r]
        if not records:
            return Protection(manifest.name, manifest.attempt, 1, errors=["no node kept its record"])
        agreed = Record.from_json(records[0], name=manifest.name, attempt=manifest.attempt)
        if agreed.topology != self.topology or agreed.scheme != self.scheme:
            log.warning(
                "not restoring %s from copies: it was protected by %s over %s, this job runs %s over %s",
                manifest.name,
                agreed.scheme.describe(),
                agreed.topology.describe(),
                self.scheme.describe(),
                self.topology.describe(),
            )
            return Protection(manifest.name, manifest.attempt, 1, errors=["another scheme or topology"])
        plan = _Plan(self, manifest, record=agreed)
        held = _dist.all_gather(plan.inventory(), self.group)
        plan.rebuild(held)
        faults.point("peers.before_restore_transfer")
        started = time.monotonic()
        received = wire.run(plan.flows, self.rank, self.group, ordered=plan.ordered)
        plan.finish()
        report = plan.report()
        if plan.parity_phase is not None:  # parity blocks of lost holders: from the rebuilt data
            held = _dist.all_gather(plan.inventory(), self.group)
            again = _Plan(self, manifest, record=agreed)
            again.reencode(held)
            received += wire.run(again.flows, self.rank, self.group)
            again.finish()
            more = again.report()
            report.parity.update(more.parity)
            report.errors += more.errors
        reports = _dist.all_gather(report, self.group)
        held = _dist.all_gather(_Plan(self, manifest, record=agreed).inventory(), self.group)
        after = _record_from_inventory(agreed, held, reports)
        if self.lead:
            # It was protected (a node kept its record): every node publishes it again with
            # the copies it has now, so each finds it without the cold tier, which serves
            # only what no copy holds (the record says how many copies each rank has left).
            self._publish(manifest, after)
        if self.rank == 0:
            try:  # the coordinator's hot manifest, as the writer left it
                if self.hot.find_manifest(manifest.name) is None:
                    self.hot.publish_manifest(manifest)
            except TierstoreError as err:
                log.error("could not publish %s in %s again: %s", manifest.name, self.hot.label, err)
        _dist.barrier(self.group)
        seconds = time.monotonic() - started
        result = Protection(
            manifest.name, manifest.attempt, after.copies, received, seconds, errors=report.errors
        )
        result.sources = report.sources
        if received:
            log.info(
                "restored %d bytes of checkpoint %s on rank %d from the other nodes (%s)",
                received,
                manifest.name,
                self.rank,
                ", ".join(sorted(set(report.sources.values()))),
            )
        return result

    # -- a load's files from other nodes ---------------------------------------------------

    def fetch(self, manifest: Manifest, paths: Sequence[str]) -> dict[str, str]:
        """Make the files of ``manifest`` this rank is about to read present on its node:
        those that neither its hot tier nor its replica namespace holds come from the rank
        that wrote them, verified, into the replica namespace. A collective: every rank
        calls it, with its own ``paths``. Returns file -> where it came from."""
        wanted = []
        for path in sorted(set(paths)):
            entry = manifest.file(path)
            if entry is None:
                continue
            if not (self._holds(self.hot, manifest, [entry]) or self._holds(self.peers, manifest, [entry])):
                wanted.append(path)
        everyone = _dist.all_gather(wanted, self.group)
        flows, sinks = [], {}
        for dst, paths_of in enumerate(everyone):
            for path in paths_of:
                entry = manifest.file(path)
                assert entry is not None
                src = entry.rank
                if self.topology.node_of(src) == self.topology.node_of(dst):
                    continue  # its own node lacks it: nothing to fetch it from (cold fallback)
                key = self.hot.file_key(manifest.name, manifest.attempt, path)
                flow = wire.Flow(src, dst, entry.size)
                if self.rank == src:
                    flow.source = _opener(self.hot, key)
                if self.rank == dst:
                    sink = FileSink(
                        self.peers, self.peers.file_key(manifest.name, manifest.attempt, path), entry
                    )
                    sinks[path] = (sink, src)
                    flow.sink = _given(sink)
                flows.append(flow)
        wire.run(flows, self.rank, self.group, ordered=False)  # files, each on its own
        got = {}
        for path, (sink, src) in sinks.items():
            if sink.ok:
                got[path] = f"peer node {self.topology.node_of(src)}"
            else:
                log.warning("could not fetch %s of %s from rank %d: %s", path, manifest.name, src, sink.error)
        return got


# -- plans -------------------------------------------------------------------------------------


@dataclass
class _Report:
    """One rank's outcome of a round: the copies it verified, by the rank they copy."""

    rank: int
    verified: dict[int, bool] = field(default_factory=dict)  # source rank -> all its files verified
    parity: dict[str, tuple[int, int]] = field(default_factory=dict)  # "node:path" -> (size, crc)
    errors: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    metadata_ok: bool = True  # the .metadata copy this rank received (if any) verified
    sent_ok: bool = True  # every file this rank read to send verified (parity: nothing checks it later)


@dataclass
class _Inventory:
    """What one rank's node holds of a checkpoint, by the rank whose files they are."""

    rank: int
    primary: bool  # this rank's own files, on its node's hot tier
    replicas: dict[int, bool]  # rank -> its files in this node's replica namespace
    parity: dict[int, bool]  # stripe -> this rank's parity block of it
    metadata: bool


class _Plan:
    """The flows of one round, built alike on every rank; the sinks of this rank's."""

    def __init__(self, peers: Peers, manifest: Manifest, record: Record | None = None) -> None:
        self.p, self.m, self.record = peers, manifest, record
        self.flows: list[wire.Flow] = []
        self.sinks: list[tuple[int, str, FileSink]] = []  # (source rank, path, sink)
        self.parity_sinks: list[_ParitySink] = []
        self.data_sinks: list[_ConcatSink] = []
        self.parity_phase: bool | None = None
        self._entries: dict[int, tuple[FileEntry, ...]] = {}
        self.checks: dict[int, _SentCheck] = {}  # this rank's files as it reads them to encode

    @property
    def ordered(self) -> bool:
        """Whether the plan's flows must complete in its order: parity's sinks combine the
        flows of several senders in turn; copies of files stand each on its own. The same
        answer on every rank (the scheme's), as the two ways must not meet in one round."""
        return isinstance(self.p.scheme, Parity)

    @property
    def topo(self) -> Topology:
        return self.p.topology

    def entries(self, rank: int) -> tuple[FileEntry, ...]:
        """``rank``'s files but ``.metadata`` (which every node keeps), by path."""
        if rank not in self._entries:
            meta = self.m.metadata_file
            self._entries[rank] = tuple(e for e in self.m.files_of_rank(rank) if e.path != meta)
        return self._entries[rank]

    def _key(self, tier: Tier, path: str) -> str:
        return tier.file_key(self.m.name, self.m.attempt, path)

    def _copy(
        self, src: int, dst: int, entry: FileEntry, *, from_peers: bool, to_primary: bool, owner: int
    ) -> None:
        """A flow of ``entry`` from ``src``'s node (its hot tier, or its replica namespace)
        to ``dst``'s (hot when it is ``dst``'s own file, else its replica namespace)."""
        flow = wire.Flow(src, dst, entry.size, tag=entry.path)
        p = self.p
        if p.rank == src:
            tier = p.peers if from_peers else p.hot
            flow.source = _opener(tier, self._key(tier, entry.path))
        if p.rank == dst:
            tier = p.hot if to_primary else p.peers
            sink = FileSink(tier, self._key(tier, entry.path), entry)
            self.sinks.append((owner, entry.path, sink))
            flow.sink = _given(sink)
        self.flows.append(flow)

    # protect

    def replicate(self) -> None:
        scheme = self.p.scheme
        assert isinstance(scheme, Replicas)
        for rank in range(self.topo.world):
            for dst in scheme.targets(rank, self.topo):
                for entry in self.entries(rank):
                    self._copy(rank, dst, entry, from_peers=False, to_primary=False, owner=rank)

    def spread_metadata(
        self, have: set[int], source_peers: bool = False, source_node: int | None = None
    ) -> None:
        """``.metadata`` to every node but those in ``have``, from its writer (or
        ``source_node``'s replica namespace)."""
        entry = _meta(self.m)
        owner = entry.rank
        src_node = self.topo.node_of(owner) if source_node is None else source_node
        src = owner if source_node is None else self.topo.rank_at(source_node, 0)
        from_peers = source_node is not None and source_node != self.topo.node_of(owner)
        for node in range(self.topo.nodes):
            if node in have or node == src_node:
                continue
            primary = node == self.topo.node_of(owner)
            dst = owner if primary else self.topo.rank_at(node, 0)
            self._copy(src, dst, entry, from_peers=from_peers or source_peers, to_primary=primary, owner=-1)

    def encode_parity(self, lost_holders: set[int] | None = None) -> None:
        """Each stripe's data chunks to its parity holders (``lost_holders``: only to those
        ranks, re-encoding what they lost), which keep the encoded blocks."""
        scheme = self.p.scheme
        assert isinstance(scheme, Parity)
        for group in scheme.groups(self.topo):
            stripes = scheme.stripes(group[0], self.topo)
            for local in range(self.topo.local_world):
                for stripe in stripes:
                    for i, holder in enumerate(stripe.parity):
                        dst = self.topo.rank_at(holder, local)
                        if lost_holders is not None and dst not in lost_holders:
                            continue
                        self._stripe_to(stripe, stripes, local, dst, block=len(stripe.data) + i)

    def _chunk(self, rank: int, stripes: list[Stripe]) -> int:
        node = self.topo.node_of(rank)
        per_node = sum(1 for s in stripes if node in s.data)
        return math.ceil(sum(e.size for e in self.entries(rank)) / per_node) if per_node else 0

    def _block_len(self, stripe: Stripe, stripes: list[Stripe], local: int) -> int:
        return max((self._chunk(self.topo.rank_at(d, local), stripes) for d in stripe.data), default=0)

    def _data_source(
        self, rank: int, stripe: Stripe, stripes: list[Stripe], offset: int, size: int
    ) -> Callable[[], wire.Source]:
        """Bytes ``offset .. offset + size`` of ``rank``'s chunk in ``stripe`` (zeros past its data)."""
        node = self.topo.node_of(rank)
        chunk = self._chunk(rank, stripes)
        j = stripe.chunk_of(node, stripes)
        start = j * chunk + offset
        length = max(0, min(size, chunk - offset))
        hot, manifest, entries = self.p.hot, self.m, self.entries(rank)
        check = self.checks.setdefault(rank, _SentCheck(entries))
        return lambda: _ConcatSource(hot, manifest, entries, start, length, size, check)

    def _stripe_to(self, stripe: Stripe, stripes: list[Stripe], local: int, dst: int, *, block: int) -> None:
        """The ``k`` data chunks of ``stripe`` (local index ``local``) to ``dst``, which encodes
        and keeps parity block ``block``, segment by segment."""
        scheme = self.p.scheme
        assert isinstance(scheme, Parity)
        k = len(stripe.data)
        length = self._block_len(stripe, stripes, local)
        sink = None
        if self.p.rank == dst:
            path = parity_path(local, stripe.index)
            expect = None
            if self.record is not None:
                expect = self.record.parity.get(f"{self.topo.node_of(dst)}:{path}")
            sink = _ParitySink(
                self.p.peers,
                self.p.peers.file_key(self.m.name, self.m.attempt, path),
                k,
                scheme.m,
                block,
                expect,
            )
            sink.path = path
            self.parity_sinks.append(sink)
        for offset in range(0, length, wire.CHUNK):
            size = min(wire.CHUNK, length - offset)
            for member, node in enumerate(stripe.data):
                src = self.topo.rank_at(node, local)
                flow = wire.Flow(src, dst, size)
                if self.p.rank == src:
                    flow.source = self._data_source(src, stripe, stripes, offset, size)
                if sink is not None:
                    flow.sink = sink.part(member)
                self.flows.append(flow)

    # restore

    def inventory(self) -> _Inventory:
        p = self.p
        meta = _meta(self.m)
        meta_here = p._holds(p.hot if meta.rank == p.rank else p.peers, self.m, [meta]) or p._holds(
            p.hot, self.m, [meta]
        )
        replicas: dict[int, bool] = {}
        parity: dict[int, bool] = {}
        if isinstance(p.scheme, Replicas):
            for rank in range(self.topo.world):
                if p.rank in p.scheme.targets(rank, self.topo):
                    replicas[rank] = p._holds(p.peers, self.m, self.entries(rank))
        else:
            stripes = p.scheme.stripes(p.node, self.topo)
            for stripe in stripes:
                if p.node in stripe.parity:
                    parity[stripe.index] = self._parity_held(stripe)
        return _Inventory(p.rank, p._holds(p.hot, self.m, self.entries(p.rank)), replicas, parity, meta_here)

    def _parity_held(self, stripe: Stripe) -> bool:
        assert self.record is not None
        path = parity_path(self.p.local, stripe.index)
        expect = self.record.parity.get(f"{self.p.node}:{path}")
        if expect is None:
            return False
        try:
            return self.p.peers.backend.stat(self._key(self.p.peers, path)).size == expect[0]
        except ObjectNotFound:
            return False

    def rebuild(self, held: list[_Inventory]) -> None:
        """Flows that bring every rank's node back to what it held: for replicas, each
        missing copy from a node that has one; for parity, each lost rank's data decoded
        from ``k`` surviving blocks of each stripe (its parity blocks next, by
        :meth:`reencode`)."""
        by_rank = {inv.rank: inv for inv in held}
        scheme = self.p.scheme
        if isinstance(scheme, Replicas):
            for rank in range(self.topo.world):
                targets = scheme.targets(rank, self.topo)
                holders = [rank, *targets]  # nearest first: its own, then the ring
                having = [
                    h
                    for h in holders
                    if (by_rank[h].primary if h == rank else by_rank[h].replicas.get(rank, False))
                ]
                if not having:
                    continue  # no copy left anywhere: the cold tier's, if any
                for h in holders:
                    has = by_rank[h].primary if h == rank else by_rank[h].replicas.get(rank, False)
                    if has:
                        continue
                    src = having[0]
                    for entry in self.entries(rank):
                        self._copy(src, h, entry, from_peers=src != rank, to_primary=h == rank, owner=rank)
        else:
            self._decode_lost(by_rank)
        meta_nodes = {self.topo.node_of(inv.rank) for inv in held if inv.metadata}
        if meta_nodes:
            owner_node = self.topo.node_of(_meta(self.m).rank)
            source = owner_node if owner_node in meta_nodes else min(meta_nodes)
            self.spread_metadata(have=meta_nodes, source_node=None if source == owner_node else source)

    def _decode_lost(self, by_rank: dict[int, _Inventory]) -> None:
        scheme = self.p.scheme
        assert isinstance(scheme, Parity)
        lost_parity: set[int] = set()
        for group in scheme.groups(self.topo):
            stripes = scheme.stripes(group[0], self.topo)
            for local in range(self.topo.local_world):
                for stripe in stripes:
                    for holder in stripe.parity:
                        r = self.topo.rank_at(holder, local)
                        if not by_rank[r].parity.get(stripe.index, False):
                            lost_parity.add(r)
                lost = [
                    self.topo.rank_at(n, local)
                    for n in group
                    if not by_rank[self.topo.rank_at(n, local)].primary
                ]
                for rank in lost:
                    self._decode_rank(rank, stripes, local, by_rank)
        self.parity_phase = True if lost_parity else None
        self._lost_parity = lost_parity

    def _decode_rank(
        self, rank: int, stripes: list[Stripe], local: int, by_rank: dict[int, _Inventory]
    ) -> None:
        """``rank``'s data, rebuilt stripe by stripe from ``k`` surviving blocks of each."""
        scheme = self.p.scheme
        assert isinstance(scheme, Parity)
        node = self.topo.node_of(rank)
        data_stripes = [s for s in stripes if node in s.data]
        sink = None
        if self.p.rank == rank:
            sink = _ConcatSink(self.p.hot, self.m, self.entries(rank))
            self.data_sinks.append(sink)
        for stripe in data_stripes:
            k = len(stripe.data)
            members = [self.topo.rank_at(n, local) for n in stripe.data] + [
                self.topo.rank_at(n, local) for n in stripe.parity
            ]
            alive = [
                (i, r)
                for i, r in enumerate(members)
                if (by_rank[r].primary if i < k else by_rank[r].parity.get(stripe.index, False))
            ][:k]
            length = self._block_len(stripe, stripes, local)
            chunk = self._chunk(rank, stripes)
            mine = stripe.data.index(node)
            if len(alive) < k:
                if sink is not None:
                    sink.fail(f"stripe {stripe.index} has {len(alive)} blocks left of the {k} needed")
                continue
            for offset in range(0, length, wire.CHUNK):
                size = min(wire.CHUNK, length - offset)
                decoder = (
                    _Decoder(k, scheme.m, mine, sink, keep=max(0, min(size, chunk - offset)))
                    if sink
                    else None
                )
                for block, src in alive:
                    flow = wire.Flow(src, rank, size)
                    if self.p.rank == src:
                        if block < k:
                            flow.source = self._data_source(src, stripe, stripes, offset, size)
                        else:
                            key = self._key(self.p.peers, parity_path(local, stripe.index))
                            peers = self.p.peers
                            flow.source = _range_opener(peers, key, offset, size)
                    if decoder is not None:
                        flow.sink = decoder.part(block)
                    self.flows.append(flow)

    def reencode(self, held: list[_Inventory]) -> None:
        by_rank = {inv.rank: inv for inv in held}
        lost = {inv.rank for inv in held if not all(inv.parity.values())}
        del by_rank
        self.encode_parity(lost_holders=lost)

    def finish(self) -> None:
        """Close what only the end of the round completes (parity blocks, rebuilt files)."""
        for psink in self.parity_sinks:
            psink.close()
        for dsink in self.data_sinks:
            dsink.close()

    def report(self) -> _Report:
        out = _Report(self.p.rank)
        for owner, path, sink in self.sinks:
            if owner >= 0:
                out.verified[owner] = out.verified.get(owner, True) and sink.ok
            else:
                out.metadata_ok = out.metadata_ok and sink.ok
            if not sink.ok:
                out.errors.append(f"{path} from rank {owner}: {sink.error}")
            else:
                out.sources[path] = "peer"
        for psink in self.parity_sinks:
            if psink.ok:
                out.parity[f"{self.p.node}:{psink.path}"] = (psink.size, psink.crc)
            else:
                out.errors.append(f"parity {psink.path}: {psink.error}")
        for dsink in self.data_sinks:
            for path in dsink.done:
                out.sources[path] = "peer"
            out.errors += dsink.errors
        for check in self.checks.values():
            if check.errors:
                out.sent_ok = False
                out.errors += check.errors
        return out


def _record(scheme: Scheme, topology: Topology, manifest: Manifest, reports: list[_Report]) -> Record:
    """The protection every rank's report proves: for each rank, the nodes whose copy of its
    files verified (a rank that wrote no file is held wherever its placement says); none
    beyond the rank's own node when any node's ``.metadata`` copy failed (that node could not
    open the checkpoint without the cold tier)."""
    by_rank = {r.rank: r for r in reports}
    holders: dict[int, list[int]] = {}
    parity: dict[str, tuple[int, int]] = {}
    for report in reports:
        parity.update(report.parity)
    metadata_ok = all(r.metadata_ok for r in reports)
    meta = manifest.metadata_file
    for rank in range(topology.world):
        nodes = [topology.node_of(rank)]
        if isinstance(scheme, Replicas) and metadata_ok:
            empty = not [e for e in manifest.files_of_rank(rank) if e.path != meta]
            nodes += [
                topology.node_of(t)
                for t in scheme.targets(rank, topology)
                if empty or by_rank[t].verified.get(rank)
            ]
        holders[rank] = nodes
    if isinstance(scheme, Parity):
        complete = metadata_ok and not any(r.errors for r in reports)
        return Record(manifest.name, manifest.attempt, scheme, topology, holders if complete else {}, parity)
    return Record(manifest.name, manifest.attempt, scheme, topology, holders, parity)


def _record_from_inventory(agreed: Record, held: list[_Inventory], reports: list[_Report]) -> Record:
    """The protection a restore left, from what every rank's node holds after it: a node
    holds a rank's copy only with the checkpoint's ``.metadata`` beside it (without it, that
    node cannot open the checkpoint without the cold tier), as a round's record counts."""
    topology, scheme = agreed.topology, agreed.scheme
    by_rank = {inv.rank: inv for inv in held}
    parity = dict(agreed.parity)
    for report in reports:
        parity.update(report.parity)
    opens = {topology.node_of(inv.rank) for inv in held if inv.metadata}
    holders: dict[int, list[int]] = {}
    if isinstance(scheme, Replicas):
        for rank in range(topology.world):
            nodes = [topology.node_of(rank)] if by_rank[rank].primary else []
            nodes += [
                topology.node_of(t) for t in scheme.targets(rank, topology) if by_rank[t].replicas.get(rank)
            ]
            holders[rank] = [node for node in nodes if node in opens]
        return Record(agreed.name, agreed.attempt, scheme, topology, holders, parity)
    whole = all(inv.primary and inv.metadata and all(inv.parity.values()) for inv in held)
    if whole:
        holders = {rank: [topology.node_of(rank)] for rank in range(topology.world)}
    return Record(agreed.name, agreed.attempt, scheme, topology, holders, parity)


# -- sources and sinks -------------------------------------------------------------------------


def _meta(manifest: Manifest) -> FileEntry:
    entry = manifest.file(manifest.metadata_file)
    assert entry is not None  # a valid manifest lists its .metadata
    return entry


def _opener(tier: Tier, key: str) -> Callable[[], wire.Source]:
    return lambda: FileSource(tier, key)


def _given(sink: Any) -> Callable[[], Any]:
    return lambda: sink


def _range_opener(tier: Tier, key: str, offset: int, size: int) -> Callable[[], wire.Source]:
    return lambda: FileSource(tier, key, offset, size)


class _ConcatSource:
    """Bytes ``start .. start + length`` of a rank's files laid end to end, then zeros up to ``size``."""

    def __init__(
        self,
        tier: Tier,
        manifest: Manifest,
        entries: Sequence[FileEntry],
        start: int,
        length: int,
        size: int,
        check: _SentCheck | None = None,
    ) -> None:
        self._parts: Any = _spans(tier, manifest, entries, start, length)
        self._left_zero = size - length
        self._check, self._at = check, start

    def read(self, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            try:
                part = next(self._parts)
            except StopIteration:
                break
            except (TierstoreError, OSError) as err:  # zeros for the rest: the check says why
                if self._check is not None:
                    self._check.errors.append(f"reading to encode failed: {err}")
                self._parts = iter(())
                break
            if self._check is not None:
                self._check.feed(self._at, part)
            self._at += len(part)
            out += part
        if len(out) < size:
            out += bytes(size - len(out))
        return bytes(out)

    def close(self) -> None:
        close = getattr(self._parts, "close", None)
        if close is not None:
            close()


def _spans(
    tier: Tier, manifest: Manifest, entries: Sequence[FileEntry], start: int, length: int
) -> Generator[bytes, None, None]:
    pos = 0
    end = start + length
    for entry in entries:
        lo, hi = max(start, pos), min(end, pos + entry.size)
        if lo < hi:
            key = tier.file_key(manifest.name, manifest.attempt, entry.path)
            with tier.backend.open_range(key, lo - pos, hi - lo) as stream:
                left = hi - lo
                while left > 0:
                    part = stream.read(min(left, wire.CHUNK))
                    if not part:
                        raise ObjectNotFound("shorter than the manifest says", key=key, tier=tier.label)
                    left -= len(part)
                    yield part
        pos += entry.size
        if pos >= end:
            return


class _SentCheck:
    """A rank's files checked against the manifest as a parity round reads them in order (the
    first pass over the rank's data is sequential: chunk ``j`` in stripe order, segment by
    segment); reads out of that order (the other parity holders' passes) are not fed twice.
    A parity block encodes what it is sent: nothing downstream could tell a bad byte."""

    def __init__(self, entries: Sequence[FileEntry]) -> None:
        self._entries = list(entries)
        self._index, self._pos, self._file_at, self._crc = 0, 0, 0, 0
        self.errors: list[str] = []

    def feed(self, offset: int, data: bytes) -> None:
        if offset != self._pos:
            return
        view = memoryview(data)
        while len(view) and self._index < len(self._entries):
            entry = self._entries[self._index]
            take = min(len(view), entry.size - self._file_at)
            self._crc = crc32c_update(self._crc, view[:take])
            self._file_at += take
            self._pos += take
            view = view[take:]
            if self._file_at == entry.size:
                if self._crc != entry.crc32c:
                    self.errors.append(
                        f"{entry.path} on this node's disk does not match the manifest (CRC32C "
                        f"{self._crc:08x}, not {entry.crc32c:08x}): not encoded into parity"
                    )
                self._index, self._file_at, self._crc = self._index + 1, 0, 0


class _ConcatSink:
    """A rank's files rebuilt in order from consecutive chunks; each kept once its bytes
    verify against the manifest. Bytes past the last file (a chunk's padding) are dropped."""

    def __init__(self, tier: Tier, manifest: Manifest, entries: Sequence[FileEntry]) -> None:
        self.tier, self.m = tier, manifest
        self._entries = list(entries)
        self._index = 0
        self._sink: FileSink | None = None
        self._left = 0
        self.done: list[str] = []
        self.errors: list[str] = []
        self._failed = False
        self._open_next()

    def _open_next(self) -> None:
        while self._index < len(self._entries):
            entry = self._entries[self._index]
            self._sink = FileSink(
                self.tier, self.tier.file_key(self.m.name, self.m.attempt, entry.path), entry
            )
            self._left = entry.size
            if entry.size:
                return
            self._close_current()
        self._sink = None

    def _close_current(self) -> None:
        assert self._sink is not None
        entry = self._entries[self._index]
        self._sink.close()
        if self._sink.ok:
            self.done.append(entry.path)
        else:
            self.errors.append(f"{entry.path} rebuilt from parity: {self._sink.error}")
        self._index += 1

    def write(self, data: memoryview) -> None:
        while len(data) and self._sink is not None:
            take = min(len(data), self._left)
            self._sink.write(data[:take])
            self._left -= take
            data = data[take:]
            if self._left == 0:
                self._close_current()
                self._open_next()

    def fail(self, why: str) -> None:
        self.errors.append(why)

    def close(self) -> None:
        """After the round: a file not rebuilt whole is not kept."""
        if self._sink is not None:
            entry = self._entries[self._index]
            self.errors.append(f"{entry.path}: not rebuilt whole from parity ({self._left} bytes short)")
            self._sink = None


class _Decoder:
    """One segment of a stripe at the rank rebuilding block ``mine``: takes ``k`` blocks,
    decodes, hands the first ``keep`` bytes of its own to ``out``."""

    def __init__(self, k: int, m: int, mine: int, out: _ConcatSink, keep: int) -> None:
        self.k, self.m, self.mine, self.out, self.keep = k, m, mine, out, keep
        self.blocks: dict[int, bytes] = {}

    def part(self, block: int) -> Callable[[], wire.Sink]:
        return lambda: _Part(self, block)

    def add(self, block: int, data: bytes) -> None:
        self.blocks[block] = data
        if len(self.blocks) == self.k:
            data_blocks = codec.decode(self.blocks, self.k, self.m)
            self.out.write(memoryview(data_blocks[self.mine])[: self.keep])
            self.blocks = {}


class _Part:
    def __init__(self, owner: Any, block: int) -> None:
        self.owner, self.block = owner, block
        self.buf = bytearray()

    def write(self, data: memoryview) -> None:
        self.buf += data

    def close(self) -> None:
        self.owner.add(self.block, bytes(self.buf))


class _ParitySink:
    """A parity holder's block of one stripe: each segment's ``k`` data chunks, encoded,
    appended to its parity file; ``expect`` (size, CRC32C) from the record when rebuilding."""

    def __init__(
        self, tier: Tier, key: str, k: int, m: int, block: int, expect: tuple[int, int] | None
    ) -> None:
        self.tier, self.key, self.k, self.m, self.block, self.expect = tier, key, k, m, block, expect
        self.blocks: dict[int, bytes] = {}
        self.ok = False
        self.error: str | None = None
        self.size, self.crc = 0, 0
        self.path = ""
        try:
            self._out: Any = tier.backend.open_write(key)
        except TierstoreError as err:
            self._out, self.error = None, str(err)
        self._segments_done = 0

    def part(self, member: int) -> Callable[[], wire.Sink]:
        return lambda: _Part(self, member)

    def add(self, member: int, data: bytes) -> None:
        self.blocks[member] = data
        if len(self.blocks) < self.k:
            return
        encoded = codec.encode([self.blocks[i] for i in range(self.k)], self.k, self.m)[self.block - self.k]
        self.blocks = {}
        self.size += len(encoded)
        self.crc = crc32c_update(self.crc, encoded)
        if self._out is not None:
            try:
                self._out.write(encoded)
            except TierstoreError as err:
                self._out.abort()
                self._out, self.error = None, str(err)

    def close(self) -> None:
        """After the round: keep the block if whole (and, rebuilt, the record's)."""
        if self._out is None:
            return
        if self.expect is not None and (self.size, self.crc) != tuple(self.expect):
            self._out.abort()
            self._out = None
            self.error = (
                f"rebuilt as {self.size} bytes of CRC32C {self.crc:08x}, the record says {self.expect}"
            )
            return
        try:
            self._out.close()
            self.ok = True
        except TierstoreError as err:
            self.error = str(err)
        self._out = None
