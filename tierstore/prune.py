"""Pruning by retention policy, in the order that never leaves a trusted checkpoint broken.

For each checkpoint a tier's policy does not keep (DESIGN.md invariant 5):

1. never the newest committed checkpoint of the tier, never a hot checkpoint whose cold
   commit is still pending (when a cold tier is configured);
2. **un-publish first**: delete the manifest, so the checkpoint stops existing;
3. then, unless a load holds a live lease on it, delete its data and upload marks. A crash
   anywhere leaves at worst unreferenced data, which :mod:`tierstore.gc` removes later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierstore import faults, layout
from tierstore.catalog import Tier, TierURL, make_tiers
from tierstore.leases import live_leases
from tierstore.manifest import Manifest
from tierstore.migrator import was_migrated
from tierstore.retention import DEFAULT_COLD, DEFAULT_HOT, Policy

__all__ = ["PruneReport", "prune", "prune_tier", "prune_node_local", "plan_prune", "pending_in_cold"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PruneReport:
    tier: str
    kept: tuple[str, ...]
    deleted: tuple[str, ...]  # un-published, data deleted
    deferred: tuple[str, ...] = ()  # un-published, data left for GC (a load is using it)
    protected: tuple[str, ...] = ()  # the policy would drop them; a safety rule keeps them
    bytes_freed: int = 0
    dry_run: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False)


def _order(m: Manifest) -> tuple[int, float, str]:
    return (-1 if m.step is None else m.step, m.created, m.name)


def plan_prune(manifests: Iterable[Manifest], policy: Policy, *, protect: Iterable[str] = (),
               now: float) -> tuple[list[Manifest], set[str], set[str]]:
    """``(to_delete oldest first, kept, protected)``: pure, no storage touched."""
    manifests = sorted(manifests, key=_order)
    if not manifests:
        return [], set(), set()
    wanted = set(policy.keep(manifests, now=now))
    forced = {manifests[-1].name} | set(protect)  # the newest, and whatever the caller protects
    kept = wanted | forced
    protected = forced - wanted
    return [m for m in manifests if m.name not in kept], kept, protected


def prune_tier(tier: Tier, policy: Policy, *, protect: Iterable[str] = (), dry_run: bool = False,
               now: float | None = None) -> PruneReport:
    """Apply ``policy`` to one tier (see the module docstring for the order)."""
    now = time.time() if now is None else now
    doomed, kept, protected = plan_prune(tier.manifests(), policy, protect=protect, now=now)
    deleted, deferred, freed = [], [], 0
    for manifest in doomed:
        if dry_run:
            deleted.append(manifest.name)
            freed += manifest.total_size
            continue
        faults.point("prune.before_unpublish")
        tier.backend.delete(layout.manifest_key(manifest.name))  # un-publish first
        faults.point("prune.after_unpublish")
        if live_leases(tier, manifest.name, now=now):
            log.info("pruned %s from %s; its data stays until the load using it ends (GC)",
                     manifest.name, tier.label)
            deferred.append(manifest.name)
            continue
        freed += delete_data(tier, manifest)
        deleted.append(manifest.name)
    if deleted or deferred:
        log.info("pruned %s from %s (kept %s)", deleted + deferred, tier.label, sorted(kept))
    return PruneReport(tier=tier.label, kept=tuple(sorted(kept)), deleted=tuple(deleted),
                       deferred=tuple(deferred), protected=tuple(sorted(protected)),
                       bytes_freed=freed, dry_run=dry_run)


def delete_data(tier: Tier, manifest: Manifest) -> int:
    """Delete an un-published attempt's files and upload marks; return bytes freed."""
    freed = 0
    for entry in manifest.files:
        tier.backend.delete(tier.file_key(manifest.name, manifest.attempt, entry.path))
        freed += entry.size
        faults.point("prune.after_file_delete")
    for info in list(tier.backend.list(layout.upload_prefix(manifest.name, manifest.attempt))):
        tier.backend.delete(info.key)
    tier.backend.delete(layout.migrated_key(manifest.name, manifest.attempt))
    return freed


def prune_node_local(hot: Tier, cold: Tier, policy: Policy, *, dry_run: bool = False,
                     now: float | None = None) -> PruneReport:
    """Prune one node's own hot root in node-local mode.

    The node sees only its ranks' files (and, on the coordinator's node, hot manifests); the
    cold tier is the global catalog. Local copies of checkpoints committed in cold and not
    kept by ``policy`` (nor the newest) are deleted; anything not yet committed in cold is
    pending and kept.
    """
    now = time.time() if now is None else now
    committed = cold.manifests()
    doomed, kept, protected = plan_prune(committed, policy, now=now)
    deleted, freed = [], 0
    for manifest in doomed:
        local = [f for f in manifest.files
                 if hot.backend.exists(hot.file_key(manifest.name, manifest.attempt, f.path))]
        here = hot.find_manifest(manifest.name)
        if not local and here is None:
            continue
        deleted.append(manifest.name)
        freed += sum(f.size for f in local)
        if dry_run:
            continue
        if here is not None and here.attempt == manifest.attempt:
            hot.backend.delete(layout.manifest_key(manifest.name))  # un-publish first
        if not live_leases(hot, manifest.name, now=now):
            delete_data(hot, manifest)
    return PruneReport(tier=hot.label, kept=tuple(sorted(kept)), deleted=tuple(deleted),
                       protected=tuple(sorted(protected)), bytes_freed=freed, dry_run=dry_run)


def pending_in_cold(hot: Tier, cold: Tier) -> set[str]:
    """Hot checkpoints never committed in cold (one the cold policy pruned is not pending)."""
    committed = {(m.name, m.attempt) for m in cold.manifests()}
    return {m.name for m in hot.manifests()
            if (m.name, m.attempt) not in committed and not was_migrated(hot, m)}


def prune(hot: TierURL | None, cold: TierURL | None = None, *, hot_policy: Policy = DEFAULT_HOT,
          cold_policy: Policy = DEFAULT_COLD, hot_options: dict[str, Any] | None = None,
          cold_options: dict[str, Any] | None = None, dry_run: bool = False,
          now: float | None = None) -> list[PruneReport]:
    """Prune every tier of a store by its policy; hot checkpoints pending cold are kept."""
    tiers = {t.role: t for t in make_tiers(hot, cold, hot_options=hot_options, cold_options=cold_options)}
    reports = []
    if "hot" in tiers:
        protect = pending_in_cold(tiers["hot"], tiers["cold"]) if "cold" in tiers else set()
        reports.append(prune_tier(tiers["hot"], hot_policy, protect=protect, dry_run=dry_run, now=now))
    if "cold" in tiers:
        reports.append(prune_tier(tiers["cold"], cold_policy, dry_run=dry_run, now=now))
    return reports
