"""Pruning by retention policy, in the order that never leaves a trusted checkpoint broken.

**One view per decision** (docs/design.md invariant 19). A round lists a tier's manifests
once, decides from that listing, and acts only on checkpoints of that listing: one committed
after the listing (by a save, a migration, a restore) is never touched by the round, and a
name committed again since (a new attempt after a quarantine, the same attempt restored) is
left alone too, since the un-publish deletes only the very root the round listed
(:meth:`~tierstore.tiers.tier.Tier.unpublish`). For each checkpoint a tier's policy does not
keep (invariants 14-16):

1. never the newest committed checkpoint of the tier, and (when a cold tier is configured)
   never a hot checkpoint unless the *current* cold tier holds a valid manifest of the same
   attempt, or the hot tier's migrated mark names the current cold tier's identity (it was
   committed there and that tier's own policy pruned it since). A torn or invalid cold
   manifest, a cold tier that cannot be read, or one holding another attempt protects the
   hot copy, and the report says why. The hot tier's protected set comes from the same
   listing the plan is made from, and each hot checkpoint is held against the cold tier
   *again* immediately before it is un-published (:class:`ColdGuard`);
2. **un-publish first**: delete the manifest, so the checkpoint stops existing;
3. then, unless a load holds a live lease on it, delete its data, manifest parts and marks
   in batches (:meth:`~tierstore.storage.backend.Backend.delete_many`: one request per 1,000
   keys on S3). A crash anywhere leaves at worst unreferenced data, which
   :mod:`tierstore.lifecycle.gc` removes later.

Deciding what to prune reads the tiers' manifest roots only (cached by the tier: they never
change once published); deleting a checkpoint reads its parts, to name its files. The hot
and the cold tier are pruned in parallel: each follows its own policy, and the hot tier's
safety checks read the cold tier's manifests whichever order the two run in.

A failure on one checkpoint is reported (``PruneReport.errors``) and pruning goes on with
the others: one damaged object never stops the rest.

Fault points (the crash suite's gates, one between each read and the act it decides):
``prune.after_listing`` (a tier listed, nothing decided), ``prune.after_cold_check`` (hot
checkpoints held against the cold tier, nothing deleted), ``prune.before_unpublish`` (one
checkpoint re-checked, not yet un-published), ``prune.after_unpublish`` (before the lease
check), ``prune.after_lease_check`` (no live lease seen, data not yet deleted),
``prune.after_file_delete``.

Why one module of about 470 lines: every deletion by policy goes through it (hot, cold,
node-local, disk pressure), and keeping them together keeps the one-view rule and its gates
visible in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from tierstore.errors import ObjectNotFound, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.lifecycle.retention import DEFAULT_COLD, DEFAULT_HOT, Policy
from tierstore.redundancy.records import drop_copies
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers import marks
from tierstore.tiers.leases import live_leases
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = [
    "PruneReport",
    "ColdCheck",
    "ColdGuard",
    "prune",
    "prune_tier",
    "prune_hot",
    "prune_node_local",
    "plan_prune",
    "pending_in_cold",
    "check_cold_copies",
]

log = logging.getLogger(__name__)

BATCH = 1000  # keys per delete_many call: S3's DeleteObjects limit, and a crash-test step


@dataclass(frozen=True)
class PruneReport:
    tier: str
    kept: tuple[str, ...]
    deleted: tuple[str, ...]  # un-published, data deleted
    deferred: tuple[str, ...] = ()  # un-published, data left for GC (a load is using it)
    protected: tuple[str, ...] = ()  # the policy would drop them; a safety rule keeps them
    bytes_freed: int = 0
    dry_run: bool = False
    warnings: tuple[str, ...] = ()  # why hot copies were kept beyond the plain rules
    errors: tuple[str, ...] = ()  # checkpoints (or the whole tier) that could not be pruned
    pending: tuple[str, ...] = ()  # hot checkpoints never committed in the cold tier
    cold_read: bool = True  # False: the cold tier could not be read, ``pending`` is unknown


@dataclass
class _Tally:
    """What one prune of one tier has done so far, for its :class:`PruneReport`."""

    kept: set[str]
    protected: set[str]
    notes: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    freed: int = 0

    def report(self, tier: Tier, dry_run: bool) -> PruneReport:
        return PruneReport(
            tier=tier.label,
            kept=tuple(sorted(self.kept)),
            deleted=tuple(self.deleted),
            deferred=tuple(self.deferred),
            protected=tuple(sorted(self.protected)),
            bytes_freed=self.freed,
            dry_run=dry_run,
            warnings=tuple(self.notes),
            errors=tuple(self.errors),
        )


def plan_prune(
    manifests: Iterable[Manifest], policy: Policy, *, protect: Iterable[str] = (), now: float
) -> tuple[list[Manifest], set[str], set[str]]:
    """``(to_delete oldest first, kept, protected)``: pure, no storage touched."""
    manifests = sorted(manifests, key=checkpoint_order)
    if not manifests:
        return [], set(), set()
    wanted = set(policy.keep(manifests, now=now))
    forced = {manifests[-1].name} | set(protect)  # the newest, and whatever the caller protects
    kept = wanted | forced
    protected = forced - wanted
    return [m for m in manifests if m.name not in kept], kept, protected


#: Asked right before a checkpoint is un-published: ``None`` to go ahead, else why it stays.
StillSafe = Callable[[Manifest], "str | None"]


def prune_tier(
    tier: Tier,
    policy: Policy,
    *,
    protect: Iterable[str] = (),
    dry_run: bool = False,
    now: float | None = None,
    warnings: Iterable[str] = (),
    manifests: Sequence[Manifest] | None = None,
    still_safe: StillSafe | None = None,
) -> PruneReport:
    """Apply ``policy`` to one tier (see the module docstring for the order).

    ``manifests``: the listing to decide from (default: the tier listed once, now); only
    checkpoints of it are touched. ``still_safe``: asked about each doomed checkpoint right
    before its un-publish (:class:`ColdGuard` for a hot tier); a reason keeps it, reported
    in ``protected`` and ``warnings``.
    """
    now = time.time() if now is None else now
    listing = list(tier.manifests() if manifests is None else manifests)
    faults.point("prune.after_listing")
    doomed, kept, protected = plan_prune(listing, policy, protect=protect, now=now)
    tally = _Tally(kept, protected, notes=list(warnings))
    for manifest in doomed:
        try:
            why = still_safe(manifest) if still_safe is not None else None
            if why is not None:
                log.warning("kept %s in %s: %s", manifest.name, tier.label, why)
                tally.notes.append(f"{manifest.name}: {why}")
                kept.add(manifest.name)
                protected.add(manifest.name)
                continue
            if dry_run:
                tally.deleted.append(manifest.name)
                tally.freed += manifest.total_size
                continue
            faults.point("prune.before_unpublish")
            if not tier.unpublish(manifest):  # un-publish first, and only what was listed
                log.info(
                    "left %s in %s alone: committed again since this prune listed it",
                    manifest.name,
                    tier.label,
                )
                continue
            faults.point("prune.after_unpublish")
            if live_leases(tier, manifest.name):
                log.info(
                    "pruned %s from %s; its data stays until the load using it ends (GC)",
                    manifest.name,
                    tier.label,
                )
                tally.deferred.append(manifest.name)
                continue
            faults.point("prune.after_lease_check")
            if tier.backend.exists(layout.quarantine_key(manifest.name, manifest.attempt)):
                # A resume quarantined it after this prune listed it: only a person removes
                # its data (docs/design.md invariant 21).
                log.warning("left the data of %s in %s: it is quarantined", manifest.name, tier.label)
                tally.deferred.append(manifest.name)
                continue
            tally.freed += delete_data(tier, manifest)
        except TierstoreError as err:
            log.error(
                "could not prune %s from %s (going on with the others): %s", manifest.name, tier.label, err
            )
            tally.errors.append(f"{manifest.name}: {err}")
            continue
        tally.deleted.append(manifest.name)
    if (tally.deleted or tally.deferred) and not dry_run:
        log.info("pruned %s from %s (kept %s)", tally.deleted + tally.deferred, tier.label, sorted(kept))
    return tally.report(tier, dry_run)


def prune_hot(
    hot: Tier, cold: Tier | None, policy: Policy, *, dry_run: bool = False, now: float | None = None
) -> PruneReport:
    """Prune a (shared) hot tier: one listing, held against the cold tier, then the plan;
    every doomed checkpoint is held against the cold tier again right before it goes."""
    listing = hot.manifests()
    if cold is None:
        return prune_tier(hot, policy, dry_run=dry_run, now=now, manifests=listing)
    check = check_cold_copies(hot, cold, listing)
    faults.point("prune.after_cold_check")
    report = prune_tier(
        hot,
        policy,
        protect=check.protect,
        dry_run=dry_run,
        now=now,
        warnings=check.warnings,
        manifests=listing,
        still_safe=ColdGuard(hot, cold),
    )
    return replace(report, pending=tuple(sorted(check.pending)), cold_read=check.cold_read)


def delete_data(tier: Tier, manifest: Manifest) -> int:
    """Delete an un-published attempt's files, manifest parts and marks; return bytes freed."""
    name, attempt = manifest.name, manifest.attempt
    prefixes = layout.attempt_prefixes(name, attempt, manifest.world_size, spread=tier.backend.spread_keys)
    if manifest.parts and prefixes is not None:
        # A two-level manifest: the attempt's keys from listings of its prefixes (one
        # request per 1,000 keys), never by reading every part (bytes that grow with W).
        keys = [info.key for prefix in prefixes for info in tier.backend.list(prefix)]
    else:
        paths = [entry.path for entry in manifest.files] + [ref.path for ref in manifest.parts]
        keys = [tier.file_key(name, attempt, path) for path in paths]
    delete_batched(tier, keys)
    delete_batched(tier, _mark_keys(tier, name, attempt), fault=None)
    return manifest.total_size


def delete_batched(tier: Tier, keys: Sequence[str], *, fault: str | None = "prune.after_file_delete") -> None:
    """Delete ``keys`` from ``tier``, :data:`BATCH` keys per request where the backend batches."""
    for start in range(0, len(keys), BATCH):
        tier.backend.delete_many(keys[start : start + BATCH])
        if fault is not None:
            faults.point(fault)


def _mark_keys(tier: Tier, name: str, attempt: str) -> list[str]:
    """An attempt's upload, failure and migrated marks: one listing of each prefix."""
    prefixes = (layout.upload_prefix(name, attempt), layout.migrated_prefix(name, attempt))
    return [info.key for prefix in prefixes for info in tier.backend.list(prefix)]


def prune_node_local(
    hot: Tier,
    cold: Tier,
    policy: Policy,
    *,
    dry_run: bool = False,
    now: float | None = None,
    peers: Tier | None = None,
) -> PruneReport:
    """Prune one node's own hot root in node-local mode.

    The node sees only its ranks' files (and, on the coordinator's node, hot manifests); the
    cold tier is the global catalog. Local copies of checkpoints committed in cold and not
    kept by ``policy`` (nor the newest) are deleted; anything not yet committed in cold is
    pending and kept: the decision is made from one listing of the cold tier, and only the
    attempts that listing names are touched. Every rank runs this after each save: it reads
    the cold manifests' roots (cached by the tier) and finds a doomed attempt's local files
    by one listing of this node's hot root, never by the manifest's parts (every rank's
    files). One checkpoint that fails is reported and the others go on; one a load holds a
    lease on keeps its files (``deferred``).

    ``peers``: this node's copies of other nodes' files (:mod:`tierstore.redundancy`); a
    checkpoint pruned here loses its copies here with it. A checkpoint the cold tier has not
    committed is never touched, so its last verified copies stay wherever they are.
    """
    now = time.time() if now is None else now
    committed = cold.manifests()
    faults.point("prune.after_listing")
    doomed, kept, protected = plan_prune(committed, policy, now=now)
    tally = _Tally(kept, protected)
    for manifest in doomed:
        try:
            local = _held_here(hot, manifest)
            here = hot.find_manifest(manifest.name)
            if here is not None and here.attempt != manifest.attempt:
                here = None  # another attempt of the name: not this decision's to touch
            copied = peers is not None and _copies_here(peers, manifest)
            if not local and here is None and not copied:
                continue
            if dry_run:
                tally.deleted.append(manifest.name)
                tally.freed += sum(info.size for info in local)
                continue
            faults.point("prune.before_unpublish")
            if here is not None and not hot.unpublish(here):  # un-publish first
                continue
            faults.point("prune.after_unpublish")
            if live_leases(hot, manifest.name):
                tally.deferred.append(manifest.name)
                continue
            faults.point("prune.after_lease_check")
            if copied:  # the protection first: no node publishes one whose own files are gone
                assert peers is not None
                tally.freed += drop_copies(peers, manifest)
            delete_batched(hot, [info.key for info in local])
            delete_batched(hot, _mark_keys(hot, manifest.name, manifest.attempt), fault=None)
        except TierstoreError as err:
            log.error(
                "could not prune the local copy of %s from %s (going on with the others): %s",
                manifest.name,
                hot.label,
                err,
            )
            tally.errors.append(f"{manifest.name}: {err}")
            continue
        tally.deleted.append(manifest.name)
        tally.freed += sum(info.size for info in local)
    return tally.report(hot, dry_run)


def _copies_here(peers: Tier, manifest: Manifest) -> bool:
    """Whether this node keeps copies of ``manifest``'s attempt for other nodes."""
    if any(True for _ in peers.backend.list(layout.attempt_prefix(manifest.name, manifest.attempt))):
        return True
    here = peers.find_manifest(manifest.name)
    return here is not None and here.attempt == manifest.attempt


def _held_here(hot: Tier, manifest: Manifest) -> list[ObjectInfo]:
    """The objects of ``manifest``'s attempt that ``hot`` holds (a node's share of them)."""
    name, attempt = manifest.name, manifest.attempt
    if not hot.backend.spread_keys:  # the attempt is one directory: list it
        return list(hot.backend.list(layout.attempt_prefix(name, attempt)))
    found = []  # keys spread over many prefixes: ask for each file
    for path in [entry.path for entry in manifest.files] + [ref.path for ref in manifest.parts]:
        try:
            found.append(hot.backend.stat(hot.file_key(name, attempt, path)))
        except ObjectNotFound:
            continue
    return found


@dataclass(frozen=True)
class ColdCheck:
    """Which hot checkpoints the cold tier does not (provably) hold, and why."""

    protect: frozenset[str]  # hot copies that must stay
    warnings: tuple[str, ...] = ()  # what was wrong, beyond "not migrated yet"
    pending: frozenset[str] = frozenset()  # of those, never committed in this cold tier
    cold_read: bool = True  # False: the cold tier could not be read (``pending`` unknown)


def check_cold_copies(hot: Tier, cold: Tier, manifests: Sequence[Manifest] | None = None) -> ColdCheck:
    """Hold each hot checkpoint against the *current* cold tier (docs/design.md invariant 15).

    A hot copy may go only if the cold tier holds a valid manifest of the same attempt, or
    the hot tier's migrated mark names this cold tier's identity (committed there once,
    pruned there since by its own policy). Anything else protects it: pending, a torn or
    invalid cold manifest, another attempt under the name, an unreadable cold tier.
    ``manifests``: the hot listing a prune decides from (default: one listing now).
    """
    hot_manifests = list(hot.manifests() if manifests is None else manifests)
    if not hot_manifests:  # nothing to hold against the cold tier: no request to it
        return ColdCheck(frozenset())
    try:
        cold_id = marks.store_id(cold)
        # One listing of the cold roots (each parsed once by the tier), not a read per name.
        found, invalid = cold.scan_manifests()
    except TierstoreError as err:
        why = f"cold tier {cold.label} cannot be read ({err}); every hot checkpoint kept"
        log.warning("%s", why)
        return ColdCheck(frozenset(m.name for m in hot_manifests), (why,), cold_read=False)
    in_cold = {m.name: m for m in found}
    damaged = {err.checkpoint: err for err in invalid}
    protect, warnings, pending = set(), [], set()
    for manifest in hot_manifests:
        there = in_cold.get(manifest.name)
        if there is None and manifest.name in damaged:
            warnings.append(
                f"{manifest.name}: the cold manifest is invalid ({damaged[manifest.name]}); hot copy kept"
            )
            protect.add(manifest.name)
            continue
        if there is not None:
            if there != manifest:
                warnings.append(
                    f"{manifest.name}: cold tier holds another attempt "
                    f"({there.attempt}); hot attempt {manifest.attempt} kept"
                )
                protect.add(manifest.name)
            elif cold_id is not None and not marks.was_migrated(hot, manifest, cold_id):
                marks.mark_migrated(hot, manifest, cold_id)  # lost to a crash after the commit
            continue
        if not marks.was_migrated(hot, manifest, cold_id):
            protect.add(manifest.name)  # pending: never committed in this cold tier
            pending.add(manifest.name)
    for why in warnings:
        log.warning("%s", why)
    return ColdCheck(frozenset(protect), tuple(warnings), frozenset(pending))


class ColdGuard:
    """Holds one hot checkpoint against the cold tier right before its un-publish.

    The check of the round (:func:`check_cold_copies`) may be seconds old on a slow cold
    tier; this asks again, per checkpoint, the only question that matters: does the
    current cold tier hold this attempt (its manifest, or a migrated mark naming its
    identity, read afresh)? Any doubt keeps the hot copy.
    """

    def __init__(self, hot: Tier, cold: Tier) -> None:
        self.hot, self.cold = hot, cold

    def __call__(self, manifest: Manifest) -> str | None:
        try:
            there = self.cold.find_manifest(manifest.name)
            if there == manifest:
                return None
            if there is None and marks.was_migrated(self.hot, manifest, marks.store_id(self.cold)):
                return None
        except TierstoreError as err:
            return f"the cold tier {self.cold.label} could not confirm its copy ({err})"
        if there is not None:
            return f"the cold tier holds another attempt ({there.attempt})"
        return f"not committed in the cold tier {self.cold.label}"


def pending_in_cold(hot: Tier, cold: Tier) -> set[str]:
    """Hot checkpoints the current cold tier does not provably hold (see :func:`check_cold_copies`)."""
    return set(check_cold_copies(hot, cold).protect)


def prune(
    store: Store | TierURL,
    *,
    hot_policy: Policy = DEFAULT_HOT,
    cold_policy: Policy = DEFAULT_COLD,
    dry_run: bool = False,
    now: float | None = None,
    prune_cold: bool = True,
) -> list[PruneReport]:
    """Prune every tier of a store by its policy; hot checkpoints not provably in cold are
    kept. A tier that cannot be pruned at all is reported in its report's ``errors``.

    A node-local store's hot tier is this node's own hot root (:func:`prune_node_local`).
    ``prune_cold=False`` leaves the cold tier alone (a job prunes it from one rank only).
    """
    store = Store.of(store)
    hot_tier, cold_tier = store.hot, store.cold
    jobs: list[tuple[Tier, Callable[[], PruneReport]]] = []
    if hot_tier is not None and cold_tier is not None and store.node_local:
        jobs.append(
            (
                hot_tier,
                lambda: prune_node_local(
                    hot_tier, cold_tier, hot_policy, dry_run=dry_run, now=now, peers=store.peers
                ),
            )
        )
    elif hot_tier is not None:
        jobs.append((hot_tier, lambda: prune_hot(hot_tier, cold_tier, hot_policy, dry_run=dry_run, now=now)))
    if cold_tier is not None and prune_cold:
        jobs.append((cold_tier, lambda: prune_tier(cold_tier, cold_policy, dry_run=dry_run, now=now)))
    if len(jobs) == 1:
        return [_guarded(*jobs[0])]
    # Plain threads, not a pool: a background prune still running as the interpreter shuts
    # down must not meet "cannot schedule new futures after interpreter shutdown".
    reports: list[PruneReport | None] = [None] * len(jobs)
    raised: list[BaseException] = []

    def run(index: int) -> None:
        try:
            reports[index] = _guarded(*jobs[index])
        except BaseException as err:  # raised below, on the caller's thread
            raised.append(err)

    threads = [
        threading.Thread(target=run, args=(i,), name="tierstore-prune", daemon=True)
        for i in range(1, len(jobs))
    ]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if raised:
        raise raised[0]
    return [r for r in reports if r is not None]


def _guarded(tier: Tier, run: Callable[[], PruneReport]) -> PruneReport:
    try:
        report = run()
    except TierstoreError as err:
        log.error("could not prune %s: %s", tier.label, err)
        return PruneReport(tier=tier.label, kept=(), deleted=(), errors=(f"{tier.label}: {err}",))
    return report
