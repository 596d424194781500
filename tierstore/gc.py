"""Garbage collection: remove what no manifest names, and only that.

Garbage is, per tier:

* data of attempts that no manifest in *any* tier references (dead or losing attempts,
  data left by an interrupted prune), once every file of the attempt is older than ``grace``
  and no live lease says a load is still reading it;
* files inside a referenced attempt that its manifest does not list, older than ``grace``;
* upload marks of attempts already committed in that tier, or referenced nowhere and old;
* "migrated" marks of checkpoints no longer in the (hot) tier;
* leftover publish temporaries and expired leases, older than ``grace``;
* backend debris such as S3 incomplete multipart uploads older than ``grace``.

Manifests of other tiers count: cold uploads of a checkpoint still pending (only its hot
manifest exists) are never garbage. The grace period protects attempts still being written
and migrations in flight, so keep it well above your longest save.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tierstore import layout
from tierstore.backend import ObjectInfo
from tierstore.catalog import Tier, TierURL, make_tiers
from tierstore.errors import ObjectNotFound
from tierstore.leases import live_leases
from tierstore.manifest import Manifest

__all__ = ["Garbage", "GCReport", "find_garbage", "collect_garbage", "DEFAULT_GRACE"]

log = logging.getLogger(__name__)

DEFAULT_GRACE = 24 * 3600.0


@dataclass(frozen=True)
class Garbage:
    tier: str
    key: str
    size: int
    reason: str


@dataclass(frozen=True)
class GCReport:
    garbage: tuple[Garbage, ...]
    deleted: bool
    aborted_uploads: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(g.size for g in self.garbage)


def _old(info: ObjectInfo, now: float, grace: float) -> bool:
    return info.mtime is not None and now - info.mtime >= grace


def _tier_garbage(tier: Tier, referenced: dict[tuple[str, str], Manifest],
                  committed_here: set[tuple[str, str]], now: float, grace: float) -> list[Garbage]:
    found: list[Garbage] = []
    attempts: dict[tuple[str, str], list[ObjectInfo]] = defaultdict(list)
    for info in tier.backend.list(""):
        key = info.key
        where = layout.spread_attempt_of(key)
        if where is not None:
            attempts[where].append(info)
        elif key.startswith(layout.UPLOAD_DIR + "/"):
            found += _mark_garbage(tier, info, referenced, committed_here, now, grace)
        elif key.startswith(layout.MIGRATED_DIR + "/"):
            found += _migrated_garbage(tier, info, committed_here)
        elif key.startswith(layout.LEASE_DIR + "/"):
            if _lease_expired(tier, info, now, grace):
                found.append(Garbage(tier.label, key, info.size, "expired lease"))
        elif key.startswith(layout.MANIFEST_DIR + "/") and ".tmp-" in key and _old(info, now, grace):
            found.append(Garbage(tier.label, key, info.size, "leftover publish temporary"))
    for (name, attempt), infos in attempts.items():
        manifest = referenced.get((name, attempt))
        if manifest is None:
            # Un-published by a prune while a load held a lease: the load still reads it.
            if live_leases(tier, name, now=now):
                continue
            if all(_old(i, now, grace) for i in infos):
                found += [Garbage(tier.label, i.key, i.size, "attempt named by no manifest")
                          for i in infos]
            continue
        listed = {tier.file_key(name, attempt, f.path) for f in manifest.files}
        found += [Garbage(tier.label, i.key, i.size, "file not listed in its manifest")
                  for i in infos if i.key not in listed and _old(i, now, grace)]
    return found


def _mark_garbage(tier: Tier, info: ObjectInfo, referenced: dict[tuple[str, str], Manifest],
                  committed_here: set[tuple[str, str]], now: float, grace: float) -> list[Garbage]:
    parts = info.key.split("/")
    if len(parts) != 4:
        return []
    attempt = (parts[1], parts[2])
    if attempt in committed_here:
        return [Garbage(tier.label, info.key, info.size, "upload mark of a committed checkpoint")]
    if attempt not in referenced and _old(info, now, grace):
        return [Garbage(tier.label, info.key, info.size, "upload mark of a dead attempt")]
    return []


def _migrated_garbage(tier: Tier, info: ObjectInfo, committed_here: set[tuple[str, str]]) -> list[Garbage]:
    parts = info.key.split("/")
    if len(parts) == 3 and (parts[1], parts[2].removesuffix(".json")) not in committed_here:
        return [Garbage(tier.label, info.key, info.size, "migrated mark of a pruned checkpoint")]
    return []


def _lease_expired(tier: Tier, info: ObjectInfo, now: float, grace: float) -> bool:
    try:
        expires = float(json.loads(tier.backend.read_bytes(info.key, limit=1 << 16))["expires"])
    except ObjectNotFound:
        return False
    except (ValueError, KeyError, TypeError):
        return _old(info, now, grace)
    return expires + grace <= now


def find_garbage(hot: TierURL | None, cold: TierURL | None = None, *, grace: float = DEFAULT_GRACE,
                 hot_options: dict[str, Any] | None = None,
                 cold_options: dict[str, Any] | None = None,
                 now: float | None = None) -> list[Garbage]:
    """Everything :func:`collect_garbage` would delete (nothing is touched)."""
    now = time.time() if now is None else now
    tiers = make_tiers(hot, cold, hot_options=hot_options, cold_options=cold_options)
    manifests = {t.role: t.manifests() for t in tiers}
    referenced = {(m.name, m.attempt): m for ms in manifests.values() for m in ms}
    found = []
    for tier in tiers:
        committed_here = {(m.name, m.attempt) for m in manifests[tier.role]}
        found += _tier_garbage(tier, referenced, committed_here, now, grace)
    return found


def collect_garbage(hot: TierURL | None, cold: TierURL | None = None, *,
                    grace: float = DEFAULT_GRACE, dry_run: bool = True,
                    hot_options: dict[str, Any] | None = None,
                    cold_options: dict[str, Any] | None = None,
                    now: float | None = None) -> GCReport:
    """Find garbage in every tier and, unless ``dry_run``, delete it."""
    now = time.time() if now is None else now
    garbage = find_garbage(hot, cold, grace=grace, hot_options=hot_options,
                           cold_options=cold_options, now=now)
    tiers = {t.label: t for t in make_tiers(hot, cold, hot_options=hot_options, cold_options=cold_options)}
    aborted: list[str] = []
    for tier in tiers.values():
        aborted += tier.backend.abort_stale_uploads(older_than=grace, dry_run=dry_run, now=now)
    if not dry_run:
        for item in garbage:
            tiers[item.tier].backend.delete(item.key)
        if garbage:
            log.info("garbage collected %d objects (%d bytes)", len(garbage), sum(g.size for g in garbage))
    return GCReport(garbage=tuple(garbage), deleted=not dry_run, aborted_uploads=tuple(aborted))
