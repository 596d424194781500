"""Leases: "a load is reading this checkpoint", so retention leaves its data alone.

A reader publishes ``leases/<name>/<id>.json`` (with an expiry) in each tier it reads, *then*
re-checks the manifest; the pruner un-publishes the manifest, *then* looks for live leases
before deleting data. Either the pruner sees the lease (and leaves the data to a later GC) or
the reader sees the manifest gone (and picks another checkpoint): a load never has its files
deleted under it. Leases of crashed readers simply expire.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from tierstore import layout
from tierstore.catalog import Tier
from tierstore.errors import ObjectNotFound, TierstoreError

__all__ = ["Lease", "take", "live_leases", "DEFAULT_TTL"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 6 * 3600.0


@dataclass
class Lease:
    tier: Tier
    name: str
    key: str

    def release(self) -> None:
        try:
            self.tier.backend.delete(self.key)
        except TierstoreError as err:
            log.warning("could not release lease %s in %s (it will expire): %s", self.key,
                        self.tier.label, err)


def take(tier: Tier, name: str, *, purpose: str = "load", ttl: float = DEFAULT_TTL,
         now: float | None = None) -> Lease | None:
    """Lease ``name`` in ``tier``; ``None`` (logged) if the tier refuses, e.g. read-only."""
    now = time.time() if now is None else now
    key = layout.lease_key(name, uuid.uuid4().hex)
    body = {"purpose": purpose, "host": socket.gethostname(), "pid": os.getpid(),
            "created": now, "expires": now + ttl}
    try:
        tier.backend.publish(key, json.dumps(body).encode())
    except TierstoreError as err:
        log.warning("could not lease %s in %s; a concurrent prune could delete it: %s",
                    name, tier.label, err)
        return None
    return Lease(tier, name, key)


def live_leases(tier: Tier, name: str, *, now: float | None = None) -> list[str]:
    """Keys of the unexpired leases on ``name`` in ``tier``."""
    now = time.time() if now is None else now
    live = []
    for info in tier.backend.list(layout.lease_prefix(name)):
        try:
            body = json.loads(tier.backend.read_bytes(info.key, limit=1 << 16))
            expires = float(body["expires"])
        except ObjectNotFound:
            continue
        except (ValueError, KeyError, TypeError):
            expires = (info.mtime or now) + DEFAULT_TTL  # unreadable: honour it for a TTL
        if expires > now:
            live.append(info.key)
    return live
