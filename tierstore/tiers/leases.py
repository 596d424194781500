"""Leases: "a load is reading this checkpoint", so retention leaves its data alone.

A reader publishes ``leases/<name>/<id>.json`` in each tier it reads, *then* re-checks the
manifest; the pruner un-publishes the manifest, *then* looks for live leases before deleting
data. Either the pruner sees the lease (and leaves the data to a later GC) or the reader sees
the manifest gone (and picks another checkpoint): a load never has its files deleted under it.
Leases of crashed readers simply expire. A reader without write access to a tier (read-only
credentials: an eval job reading the cold tier) loads unleased there, warned once per tier
per process, not once per load. A job loads under one lease per tier, not one per
rank: its coordinator takes it while picking the checkpoint for every rank, and releases it
once every rank's reads are over (:class:`~tierstore.dcp.reader.TieredReader`).

**Time comes from the store, never from a machine's clock.** A lease is live while
``store_now - lease.mtime < ttl``. ``lease.mtime`` is the modification time the store gave the
lease object when it was published; ``store_now`` is the modification time the store gives a
probe object (``leases/clock-<id>.probe``) published, read back and deleted just before the
check. Both are stamped by the same clock: the object store's servers, a shared filesystem's
server, the local disk's kernel for a node-local tier. So a reader whose clock is hours
behind cannot make its own lease look expired, one far ahead cannot make it last forever, and
the pruner's clock does not matter either. ``ttl`` is recorded in the lease; the reader's
``created``/``expires`` stamps are informational (for humans), and only their difference is
used, for leases written before ``ttl`` was recorded. No lease lives longer than
:data:`MAX_TTL`, whatever it records, and none has more than its ``ttl`` (plus a GC's grace)
left at any check: an mtime ahead of ``store_now`` (clock skew of a filesystem whose clients
stamp times) counts as ``store_now``, and one ahead by more than ``ttl`` cannot be the
store's own stamp (a file touched or restored with future times) and is expired, warned.

A lease that cannot be read (oversized, not JSON, a read error other than "gone") is reported
with a warning naming key and tier and honoured for :data:`DEFAULT_TTL` from its mtime: it
neither stops a prune or GC nor protects data forever. Fallbacks, for stores that cannot
stamp time: if the probe cannot be published (a read-only tier) the checker's own clock
stands in for ``store_now`` (warned); a lease the store reports no mtime for is judged by
its ``expires`` against the checker's clock, and is live if even that cannot be read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from tierstore.errors import ObjectNotFound, TierstoreError, TransientStorageError
from tierstore.format import layout
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers.tier import Tier

__all__ = ["Lease", "take", "live_leases", "expired_leases", "store_time", "DEFAULT_TTL", "MAX_TTL"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 6 * 3600.0
MAX_TTL = 7 * 24 * 3600.0  # a longer ttl, hostile or mistaken, would block pruning for good
_LEASE_LIMIT = 1 << 16
# Tiers that refused a lease for good (read-only): warned about once per process, since an
# eval job loading every checkpoint would otherwise repeat the same warning at each load.
_refused: set[str] = set()
_refused_lock = threading.Lock()


@dataclass
class Lease:
    tier: Tier
    name: str
    key: str

    def release(self) -> None:
        try:
            self.tier.backend.delete(self.key)
        except TierstoreError as err:
            log.warning(
                "could not release lease %s in %s (it will expire): %s", self.key, self.tier.label, err
            )


def take(
    tier: Tier, name: str, *, purpose: str = "load", ttl: float = DEFAULT_TTL, now: float | None = None
) -> Lease | None:
    """Lease ``name`` in ``tier`` for ``ttl`` seconds of the store's time; ``None`` (logged)
    if the tier refuses, e.g. read-only. ``now`` (this machine's clock) is only recorded."""
    now = time.time() if now is None else now
    key = layout.lease_key(name, uuid.uuid4().hex)
    body = {
        "purpose": purpose,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created": now,
        "expires": now + ttl,
        "ttl": ttl,
    }
    try:
        tier.backend.publish(key, json.dumps(body).encode())
    except TransientStorageError as err:
        log.warning("could not lease %s in %s; a concurrent prune could delete it: %s", name, tier.label, err)
        return None
    except TierstoreError as err:
        with _refused_lock:
            first = tier.label not in _refused
            _refused.add(tier.label)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "cannot write leases in %s (read-only credentials?): loading %s without a "
            "lease, so a concurrent prune could delete it; later loads from this tier "
            "are not warned about again: %s",
            tier.label,
            name,
            err,
        )
        return None
    return Lease(tier, name, key)


def store_time(tier: Tier) -> float | None:
    """The store's current time: the mtime it stamps on a probe object (then deleted).

    ``None`` (logged) if the tier refuses the probe or keeps no modification times.
    """
    key = layout.clock_probe_key(uuid.uuid4().hex)
    try:
        tier.backend.publish(key, b"{}")
        try:
            return tier.backend.stat(key).mtime
        finally:
            tier.backend.delete(key)
    except TierstoreError as err:
        log.warning(
            "cannot read the clock of %s (%s); judging leases by this machine's clock", tier.label, err
        )
        return None


def live_leases(
    tier: Tier, name: str, *, now: float | None = None, store_now: float | None = None
) -> list[str]:
    """Keys of the live leases on ``name`` in ``tier``; a damaged lease never raises.

    ``now`` is ignored: liveness is judged by the store's clock (module docstring), read with
    :func:`store_time` unless ``store_now`` gives it. Listing errors propagate: without the
    list, nothing can be known to be unleased.
    """
    infos = [
        info for info in tier.backend.list(layout.lease_prefix(name)) if not layout.is_temporary(info.key)
    ]  # a publish that never completed leased nothing
    if not infos:
        return []
    clock = _Clock(tier, store_now)
    return [info.key for info in infos if _remaining(tier, info, clock, 0.0) is not None]


def expired_leases(
    tier: Tier, infos: Iterable[ObjectInfo], *, grace: float = 0.0, store_now: float | None = None
) -> list[ObjectInfo]:
    """Those of ``infos`` (lease objects of ``tier``) expired for at least ``grace`` seconds."""
    clock = _Clock(tier, store_now)
    return [info for info in infos if _remaining(tier, info, clock, grace) is None]


class _Clock:
    """The store's time, probed at most once and only if a lease needs it."""

    def __init__(self, tier: Tier, known: float | None) -> None:
        self._tier, self._now, self._probed = tier, known, known is not None

    def now(self) -> float:
        if not self._probed:
            self._now, self._probed = store_time(self._tier), True
        return time.time() if self._now is None else self._now


def _remaining(tier: Tier, info: ObjectInfo, clock: _Clock, grace: float) -> float | None:
    """Seconds the lease ``info`` stays live (after ``grace``), ``None`` if it has expired or
    is gone."""
    try:
        body = json.loads(tier.backend.read_bytes(info.key, limit=_LEASE_LIMIT))
        ttl, expires = _ttl(body), float(body["expires"])
    except ObjectNotFound:
        return None  # released meanwhile
    except (TierstoreError, ValueError, KeyError, TypeError, RecursionError) as err:
        log.warning(
            "lease %s in %s is unreadable (%s); honouring it for %.0f s from its mtime",
            info.key,
            tier.label,
            err,
            DEFAULT_TTL,
        )
        ttl, expires = DEFAULT_TTL, None
    # No lease holds more than its ttl (+ grace) from now, whatever its stamps say.
    most = ttl + grace
    if info.mtime is None:  # a store without modification times: the lease's own word
        left = most if expires is None else min(expires + grace - time.time(), most)
        return left if left > 0 else None
    now = clock.now()
    if info.mtime - now > ttl:
        # The store cannot have stamped a time this far in its own future: the file was
        # touched, restored with its times or the clock set back. Judged from that stamp it
        # would block prune and GC until then (design.md invariants 16, 17), so it is over.
        log.warning(
            "lease %s in %s is stamped %.0f s ahead of the store's clock, more than its "
            "ttl of %.0f s; treating it as expired",
            info.key,
            tier.label,
            info.mtime - now,
            ttl,
        )
        return None
    left = min(info.mtime + ttl + grace - now, most)
    return left if left > 0 else None


def _ttl(body: object) -> float:
    if not isinstance(body, dict):
        raise TypeError("a lease is a JSON object")
    # Leases written before the ttl was recorded: the difference of two stamps of one clock.
    ttl = float(body["ttl"]) if "ttl" in body else float(body["expires"]) - float(body["created"])
    if not 0 < ttl < float("inf"):
        raise ValueError(f"bad ttl {ttl!r}")
    return min(ttl, MAX_TTL)
