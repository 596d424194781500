"""Pruning by retention policy, in the order that never leaves a trusted checkpoint broken.

For each checkpoint a tier's policy does not keep (docs/design.md invariants 14-16):

1. never the newest committed checkpoint of the tier, and (when a cold tier is configured)
   never a hot checkpoint unless the *current* cold tier holds a valid manifest of the same
   attempt, or the hot tier's migrated mark names the current cold tier's identity (it was
   committed there and that tier's own policy pruned it since). A torn or invalid cold
   manifest, a cold tier that cannot be read, or one holding another attempt protects the
   hot copy, and the report says why;
2. **un-publish first**: delete the manifest, so the checkpoint stops existing;
3. then, unless a load holds a live lease on it, delete its data and upload marks. A crash
   anywhere leaves at worst unreferenced data, which :mod:`tierstore.lifecycle.gc` removes later.

A failure on one checkpoint is reported (``PruneReport.errors``) and pruning goes on with
the others: one damaged object never stops the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierstore.commit import layout
from tierstore.commit.manifest import Manifest, checkpoint_order
from tierstore.errors import InvalidManifest, TierstoreError
from tierstore.lifecycle.leases import live_leases
from tierstore.lifecycle.retention import DEFAULT_COLD, DEFAULT_HOT, Policy
from tierstore.storage import faults
from tierstore.tiers import marks
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["PruneReport", "ColdCheck", "prune", "prune_tier", "prune_node_local", "plan_prune",
           "pending_in_cold", "check_cold_copies"]

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
    warnings: tuple[str, ...] = ()  # why hot copies were kept beyond the plain rules
    errors: tuple[str, ...] = ()  # checkpoints (or the whole tier) that could not be pruned


def plan_prune(manifests: Iterable[Manifest], policy: Policy, *, protect: Iterable[str] = (),
               now: float) -> tuple[list[Manifest], set[str], set[str]]:
    """``(to_delete oldest first, kept, protected)``: pure, no storage touched."""
    manifests = sorted(manifests, key=checkpoint_order)
    if not manifests:
        return [], set(), set()
    wanted = set(policy.keep(manifests, now=now))
    forced = {manifests[-1].name} | set(protect)  # the newest, and whatever the caller protects
    kept = wanted | forced
    protected = forced - wanted
    return [m for m in manifests if m.name not in kept], kept, protected


def prune_tier(tier: Tier, policy: Policy, *, protect: Iterable[str] = (), dry_run: bool = False,
               now: float | None = None, warnings: Iterable[str] = ()) -> PruneReport:
    """Apply ``policy`` to one tier (see the module docstring for the order)."""
    now = time.time() if now is None else now
    doomed, kept, protected = plan_prune(tier.manifests(), policy, protect=protect, now=now)
    deleted, deferred, errors, freed = [], [], [], 0
    for manifest in doomed:
        if dry_run:
            deleted.append(manifest.name)
            freed += manifest.total_size
            continue
        try:
            faults.point("prune.before_unpublish")
            tier.backend.delete(layout.manifest_key(manifest.name))  # un-publish first
            faults.point("prune.after_unpublish")
            if live_leases(tier, manifest.name):
                log.info("pruned %s from %s; its data stays until the load using it ends (GC)",
                         manifest.name, tier.label)
                deferred.append(manifest.name)
                continue
            freed += delete_data(tier, manifest)
        except TierstoreError as err:
            log.error("could not prune %s from %s (going on with the others): %s",
                      manifest.name, tier.label, err)
            errors.append(f"{manifest.name}: {err}")
            continue
        deleted.append(manifest.name)
    if deleted or deferred:
        log.info("pruned %s from %s (kept %s)", deleted + deferred, tier.label, sorted(kept))
    return PruneReport(tier=tier.label, kept=tuple(sorted(kept)), deleted=tuple(deleted),
                       deferred=tuple(deferred), protected=tuple(sorted(protected)),
                       bytes_freed=freed, dry_run=dry_run, warnings=tuple(warnings),
                       errors=tuple(errors))


def delete_data(tier: Tier, manifest: Manifest) -> int:
    """Delete an un-published attempt's files and upload marks; return bytes freed."""
    freed = 0
    for entry in manifest.files:
        tier.backend.delete(tier.file_key(manifest.name, manifest.attempt, entry.path))
        freed += entry.size
        faults.point("prune.after_file_delete")
    marks.clear_upload_marks(tier, manifest.name, manifest.attempt)
    marks.clear_migrated_marks(tier, manifest.name, manifest.attempt)
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
        if not live_leases(hot, manifest.name):
            delete_data(hot, manifest)
    return PruneReport(tier=hot.label, kept=tuple(sorted(kept)), deleted=tuple(deleted),
                       protected=tuple(sorted(protected)), bytes_freed=freed, dry_run=dry_run)


@dataclass(frozen=True)
class ColdCheck:
    """Which hot checkpoints the cold tier does not (provably) hold, and why."""

    protect: frozenset[str]  # hot copies that must stay
    warnings: tuple[str, ...] = ()  # what was wrong, beyond "not migrated yet"


def check_cold_copies(hot: Tier, cold: Tier) -> ColdCheck:
    """Hold each hot checkpoint against the *current* cold tier (docs/design.md invariant 15).

    A hot copy may go only if the cold tier holds a valid manifest of the same attempt, or
    the hot tier's migrated mark names this cold tier's identity (committed there once,
    pruned there since by its own policy). Anything else protects it: pending, a torn or
    invalid cold manifest, another attempt under the name, an unreadable cold tier.
    """
    hot_manifests = hot.manifests()
    try:
        cold_id = marks.store_id(cold)
    except TierstoreError as err:
        why = f"cold tier {cold.label} cannot be read ({err}); every hot checkpoint kept"
        log.warning("%s", why)
        return ColdCheck(frozenset(m.name for m in hot_manifests), (why,))
    protect, warnings = set(), []
    for manifest in hot_manifests:
        try:
            there = cold.find_manifest(manifest.name)
        except InvalidManifest as err:
            warnings.append(f"{manifest.name}: the cold manifest is invalid ({err}); hot copy kept")
            protect.add(manifest.name)
            continue
        except TierstoreError as err:
            warnings.append(f"{manifest.name}: cold tier {cold.label} cannot be read ({err}); "
                            "hot copy kept")
            protect.add(manifest.name)
            continue
        if there is not None:
            if there != manifest:
                warnings.append(f"{manifest.name}: cold tier holds another attempt "
                                f"({there.attempt}); hot attempt {manifest.attempt} kept")
                protect.add(manifest.name)
            elif cold_id is not None and not marks.was_migrated(hot, manifest, cold_id):
                marks.mark_migrated(hot, manifest, cold_id)  # lost to a crash after the commit
            continue
        if not marks.was_migrated(hot, manifest, cold_id):
            protect.add(manifest.name)  # pending: never committed in this cold tier
    for why in warnings:
        log.warning("%s", why)
    return ColdCheck(frozenset(protect), tuple(warnings))


def pending_in_cold(hot: Tier, cold: Tier) -> set[str]:
    """Hot checkpoints the current cold tier does not provably hold (see :func:`check_cold_copies`)."""
    return set(check_cold_copies(hot, cold).protect)


def prune(hot: TierURL | Store | None, cold: TierURL | None = None, *, hot_policy: Policy = DEFAULT_HOT,
          cold_policy: Policy = DEFAULT_COLD, hot_options: dict[str, Any] | None = None,
          cold_options: dict[str, Any] | None = None, dry_run: bool = False,
          now: float | None = None, node_local: bool = False,
          prune_cold: bool = True) -> list[PruneReport]:
    """Prune every tier of a store by its policy; hot checkpoints not provably in cold are
    kept. A tier that cannot be pruned at all is reported in its report's ``errors``.

    ``node_local``: ``hot`` is this node's own hot root (:func:`prune_node_local`).
    ``prune_cold=False`` leaves the cold tier alone (a job prunes it from one rank only).
    """
    store = Store.of(hot, cold, hot_options=hot_options, cold_options=cold_options)
    hot_tier, cold_tier = store.hot, store.cold
    reports = []
    if hot_tier is not None and node_local and cold_tier is not None:
        reports.append(_guarded(hot_tier, lambda: prune_node_local(
            hot_tier, cold_tier, hot_policy, dry_run=dry_run, now=now)))
    elif hot_tier is not None:
        check = check_cold_copies(hot_tier, cold_tier) if cold_tier is not None else ColdCheck(frozenset())
        reports.append(_guarded(hot_tier, lambda: prune_tier(
            hot_tier, hot_policy, protect=check.protect, dry_run=dry_run, now=now,
            warnings=check.warnings)))
    if cold_tier is not None and prune_cold:
        reports.append(_guarded(cold_tier, lambda: prune_tier(
            cold_tier, cold_policy, dry_run=dry_run, now=now)))
    return reports


def _guarded(tier: Tier, run: Any) -> PruneReport:
    try:
        report: PruneReport = run()
    except TierstoreError as err:
        log.error("could not prune %s: %s", tier.label, err)
        return PruneReport(tier=tier.label, kept=(), deleted=(), errors=(f"{tier.label}: {err}",))
    return report
