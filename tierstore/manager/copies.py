"""A manager's copies on other nodes (``ManagerOptions(redundancy=Replicas(2))``): the
part that protects each committed checkpoint in the background, restores a replaced node at
start, and fetches another node's files for a load (:mod:`tierstore.redundancy`).

Its collectives run on a process group of its own (gloo), on one thread of its own, one round
per settled save in the order of the saves, so they never interleave with DCP's or training's.
Every rank runs a round for every save that settled, committed or failed: the coordinator
says which checkpoint (``None``: the save failed, nothing to protect), so a save that failed
on some ranks only never leaves the others waiting in a round.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.distributed as dist

from tierstore import _dist
from tierstore.errors import ConfigError, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.redundancy import wire
from tierstore.redundancy.protect import Peers, Protection
from tierstore.redundancy.records import peer_tier
from tierstore.redundancy.schemes import Parity, Replicas, Topology
from tierstore.tiers.tier import Store

__all__ = ["PeerCopies"]

log = logging.getLogger(__name__)

GROUP_TIMEOUT = 600.0  # seconds a round's collective waits for a slow peer before failing


class PeerCopies:
    """Copies of ``store``'s checkpoints on other nodes under ``scheme``; ``None``: none
    (every method then does nothing). ``store`` must be node-local; ``node_of`` numbers
    each rank's node (default ``rank // LOCAL_WORLD_SIZE``)."""

    def __init__(
        self,
        scheme: Replicas | Parity | None,
        store: Store,
        *,
        node_of: Callable[[int], int] | None = None,
    ) -> None:
        self.scheme = scheme
        self.peers: Peers | None = None
        self.store = store
        self.restored: list[Protection] = []
        self._last: Future[Protection | None] | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._protections: dict[str, Protection] = {}
        self._errors: list[str] = []
        self._group: Any = None
        self.broken: str | None = None
        if scheme is None:
            return
        if not isinstance(scheme, (Replicas, Parity)):
            raise ConfigError(f"redundancy= takes Replicas(n) or Parity(k, m), got {scheme!r}")
        if not store.node_local or store.hot is None:
            raise ConfigError(
                f"redundancy={scheme.describe()} protects node-local hot tiers: pass "
                "Store(hot, cold, node_local=True) (a shared hot tier is one copy whatever the node)"
            )
        if not _dist.initialized():
            raise ConfigError(
                f"redundancy={scheme.describe()} needs torch.distributed: copies go to other nodes"
            )
        rank, world = _dist.rank_world()
        topology = Topology.of(world, node_of)
        scheme.check(topology)  # the same verdict on every rank: none is left in new_group
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
        self.peers = Peers(scheme, topology, self._group, rank, store.hot, peer_tier(store.hot))
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierstore-copies")

    @property
    def on(self) -> bool:
        return self.peers is not None

    def reading_store(self, store: Store) -> Store:
        """``store`` with this node's copies as a tier to find and read checkpoints in."""
        if self.peers is None:
            return store
        return store.with_peers(self.peers.peers)

    # -- at start ----------------------------------------------------------------------------

    def start(self, store: Store) -> Store:
        """At the manager's start: restore what a replaced node lost (:meth:`restore`), and
        return ``store`` with this node's copies as a tier to find and read checkpoints in
        (found there first, the cold tier last)."""
        reading = self.reading_store(store)
        self.restore()
        return reading

    def restore(self) -> list[Protection]:
        """Rebuild what a replaced node lost from the other nodes' copies (collective, at start)."""
        if self.peers is None:
            return []
        started = time.monotonic()
        try:
            self.restored = self.peers.restore()
        except (wire.PeerLost, RuntimeError) as err:  # a peer lost: gloo's collectives raise
            self._broke(err)
            return []
        moved = sum(p.received for p in self.restored)
        if moved:
            log.info("restored %d bytes from the other nodes in %.1fs", moved, time.monotonic() - started)
        return self.restored

    # -- after each save ---------------------------------------------------------------------

    def settled(self, step: int) -> None:
        """A save of ``step`` settled (committed or failed) on this rank: protect it, in the
        background, once every rank got here."""
        if self._worker is None:
            return
        with self._lock:
            self._last = self._worker.submit(self._round, step)

    def _round(self, step: int) -> Protection | None:
        peers = self.peers
        assert peers is not None
        if self.broken is not None:
            return None
        manifest: Manifest | None = None
        if peers.rank == 0:
            try:
                manifest = peers.hot.find_manifest(layout.default_name(step))
            except TierstoreError as err:
                log.error("cannot read the manifest of step %d to protect it: %s", step, err)
        try:
            done = peers.protect(manifest)
        except (wire.PeerLost, RuntimeError) as err:  # a peer lost: gloo's collectives raise
            self._broke(err)
            return None
        except Exception as err:  # never lost silently on a background thread
            log.error("protecting step %d on the other nodes failed: %s", step, err, exc_info=True)
            with self._lock:
                self._errors.append(f"step {step}: {err}")
            return None
        if done is not None:
            with self._lock:
                self._protections[done.name] = done
        return done

    def _broke(self, err: BaseException) -> None:
        self.broken = str(err)
        log.error("copies on other nodes stop for this run (a peer was lost): %s", err)
        with self._lock:
            self._errors.append(str(err))

    def wait(self, deadline: float | None) -> bool:
        """Wait until the last save's copies are verified on the peers (or ``deadline``, a
        ``time.monotonic()`` value); ``True`` if they are done."""
        with self._lock:
            last = self._last
        if last is None:
            return True
        try:
            last.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            log.warning("the copies of the last checkpoint are still being sent to the other nodes")
            return False
        return True

    # -- loads -------------------------------------------------------------------------------

    def protected(self) -> list[Manifest]:
        """The checkpoints this node's copies protect."""
        if self.peers is None:
            return []
        try:
            return self.peers.protected()
        except TierstoreError as err:
            log.warning("cannot list this node's copies: %s", err)
            return []

    def fetch(self, manifest: Manifest, paths: Sequence[str]) -> dict[str, str]:
        """``Peers.fetch`` after the rounds under way (the same group, never two at once)."""
        if self.peers is None or self.broken is not None:
            return {}
        self.wait(None)
        try:
            return self.peers.fetch(manifest, paths)
        except (wire.PeerLost, RuntimeError) as err:
            self._broke(err)
            return {}

    # -- what it says ------------------------------------------------------------------------

    def copies(self, name: str) -> int | None:
        """Verified copies protecting checkpoint ``name`` as this process knows, or ``None``."""
        with self._lock:
            done = self._protections.get(name)
        if done is None:
            done = next((p for p in self.restored if p.name == name), None)
        return None if done is None else done.copies

    def summary(self) -> dict[str, Any]:
        """For ``health()``: the scheme, each checkpoint's copies, what a restore moved."""
        if self.scheme is None:
            return {}
        with self._lock:
            copies = {name: p.copies for name, p in self._protections.items()}
            rounds = {
                name: {"seconds": p.seconds, "bytes": p.received, "copies": p.copies}
                for name, p in self._protections.items()
            }
            errors = list(self._errors)
            busy = self._last is not None and not self._last.done()
        for p in self.restored:
            copies.setdefault(p.name, p.copies)
        return {
            "scheme": self.scheme.describe(),
            "copies": copies,
            "rounds": rounds,  # each checkpoint's round on this rank: transfer seconds, bytes received
            "busy": busy,  # a round is running now
            "restored_bytes": sum(p.received for p in self.restored),
            "restore_seconds": sum(p.seconds for p in self.restored),
            "restored_from": sorted({s for p in self.restored for s in p.sources.values()}),
            "errors": errors,
            "broken": self.broken,
        }

    def describe_pending(self, names: Sequence[str]) -> str:
        """How many verified copies protect each of ``names`` (for ``MigrationFailed``)."""
        parts = []
        for name in names:
            copies = self.copies(name)
            parts.append(f"{name}: {copies or 1} verified cop{'y' if (copies or 1) == 1 else 'ies'}")
        return "; ".join(parts)

    def release(self) -> None:
        """Stop the rounds and destroy the group; a round still running (close()'s deadline
        came first: a peer that answers slowly) is left to end on its own, with its group."""
        running = False
        if self._worker is not None:
            with self._lock:
                last = self._last
            running = last is not None and not last.done()
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        if running:
            log.warning("the copies of the last checkpoint were still being sent at close's deadline")
            return
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # the default group may be gone already
                pass
            self._group = None
