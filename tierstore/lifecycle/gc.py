"""Garbage collection: remove what no manifest names, and only that.

Garbage is, per tier:

* data of attempts that no manifest in *any* tier references (dead or losing attempts,
  data left by an interrupted prune), once every file of the attempt is older than ``grace``
  and no live lease says a load is still reading it;
* files inside a referenced attempt that its manifest does not list, older than ``grace``;
* upload marks of attempts already committed in that tier, or referenced nowhere and old,
  and damaged upload marks (a key no mark has, unreadable JSON, another rank) once old;
* "migrated" marks of attempts not committed in the (hot) tier;
* leftover publish temporaries, clock probes and expired leases, older than ``grace``
  (lease expiry is judged by the store's clock: :mod:`tierstore.tiers.leases`);
* backend debris such as S3 incomplete multipart uploads older than ``grace``.

A quarantined attempt (:mod:`tierstore.lifecycle.quarantine`) is never garbage: its record,
in any tier, keeps every object of that attempt in every tier until a person removes it.

Manifests of other tiers count: cold uploads of a checkpoint still pending (only its hot
manifest exists) are never garbage. The grace period protects attempts still being written
and migrations in flight, so keep it well above your longest save.

GC never deletes what it cannot read. A manifest that exists but is invalid (torn, corrupt,
oversized) is *damaged*, not garbage: it is reported in :attr:`GCReport.damaged` and every
object of that checkpoint name (data of all its attempts, marks) is kept, since the attempt
a torn manifest names cannot be known. If a tier's manifests cannot be listed or read at all,
GC raises before deleting anything. Any other error on one object or one tier is reported in
:attr:`GCReport.failures` and the rest carries on. The tier's identity object
(``tierstore-store.json``) is never garbage.

A node-local hot root's copies of other nodes' files (``replicas/``, :mod:`tierstore.redundancy`)
are kept while that node's replica namespace publishes their attempt (parity blocks and the
protection record included), and its manifests reference the node's own files too: a
checkpoint protected by copies is never garbage on any node that holds a part of it. Copies
of an attempt the namespace never published (a round that died half-way) are garbage once
older than ``grace``.

A two-level manifest's parts live with its attempt's files and are kept while its root names
them. Garbage is deleted in batches (:meth:`~tierstore.storage.backend.Backend.delete_many`,
one request per 1,000 keys on S3), the tiers in parallel.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierstore.errors import TierstoreError
from tierstore.format import layout
from tierstore.format.layout import KeyKind
from tierstore.format.manifest import Manifest
from tierstore.redundancy.records import peer_tier
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers import marks
from tierstore.tiers.leases import expired_leases, live_leases
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["Garbage", "Problem", "GCReport", "find_garbage", "collect_garbage", "DEFAULT_GRACE"]

log = logging.getLogger(__name__)

DEFAULT_GRACE = 24 * 3600.0
_BATCH = 1000  # keys per delete_many call (S3's DeleteObjects limit)


@dataclass(frozen=True)
class Garbage:
    tier: str
    key: str
    size: int
    reason: str


@dataclass(frozen=True)
class Problem:
    """An object GC left alone because it is damaged, or an operation that failed."""

    tier: str
    key: str
    error: str


@dataclass(frozen=True)
class GCReport:
    garbage: tuple[Garbage, ...]
    deleted: bool
    aborted_uploads: tuple[str, ...] = ()
    damaged: tuple[Problem, ...] = ()  # invalid manifests: their checkpoints' data is kept
    failures: tuple[Problem, ...] = ()  # errors on single objects or tiers; the rest went on

    @property
    def bytes(self) -> int:
        return sum(g.size for g in self.garbage)


@dataclass
class _Scan:
    """What one GC pass found; shared by every tier's walk."""

    now: float
    grace: float
    referenced: dict[tuple[str, str], Manifest]
    damaged_names: set[str]
    quarantined: set[tuple[str, str]] = field(default_factory=set)
    garbage: list[Garbage] = field(default_factory=list)
    failures: list[Problem] = field(default_factory=list)

    def old(self, info: ObjectInfo) -> bool:
        return info.mtime is not None and self.now - info.mtime >= self.grace

    def add(self, tier: Tier, info: ObjectInfo, reason: str) -> None:
        self.garbage.append(Garbage(tier.label, info.key, info.size, reason))

    def fail(self, tier: Tier, key: str, err: Exception) -> None:
        log.warning("gc: %s in %s: %s", key or "listing", tier.label, err)
        self.failures.append(Problem(tier.label, key, str(err)))


def _scan(tiers: Sequence[Tier], now: float, grace: float) -> tuple[_Scan, list[Problem]]:
    # Manifest read errors propagate on purpose: without every manifest, nothing is known
    # to be unreferenced.
    scans = [(tier, *tier.scan_manifests()) for tier in tiers]
    # A hot root's replica namespace: its published manifests reference this node's files.
    copies = {tier.label: peer_tier(tier).manifests() for tier in tiers if tier.role == "hot"}
    damaged = [Problem(t.label, err.key or "", str(err)) for t, _, invalid in scans for err in invalid]
    for problem in damaged:
        log.warning("gc: keeping the data of a checkpoint with a damaged manifest: %s", problem.error)
    scan = _Scan(
        now,
        grace,
        referenced={
            **{(m.name, m.attempt): m for ms in copies.values() for m in ms},
            **{(m.name, m.attempt): m for _, ms, _ in scans for m in ms},
        },
        damaged_names={
            err.checkpoint for _, _, invalid in scans for err in invalid if err.checkpoint is not None
        },
    )
    scan.quarantined = {
        parsed
        for tier in tiers
        for info in tier.backend.list(layout.quarantine_prefix())
        if (parsed := layout.parse_quarantine_key(info.key)) is not None
    }
    for tier, manifests, _ in scans:
        try:
            published = {(m.name, m.attempt) for m in copies.get(tier.label, [])}
            _tier_garbage(tier, scan, {(m.name, m.attempt) for m in manifests}, published)
        except TierstoreError as err:  # e.g. the tier cannot be listed: the others go on
            scan.fail(tier, "", err)
    return scan, damaged


def _tier_garbage(
    tier: Tier, scan: _Scan, committed_here: set[tuple[str, str]], copies: set[tuple[str, str]]
) -> None:
    attempts: dict[tuple[str, str], list[ObjectInfo]] = defaultdict(list)
    lease_infos: list[ObjectInfo] = []
    for info in tier.backend.list(""):
        kind = layout.kind_of(info.key)  # the tier's identity object is never garbage
        if kind is KeyKind.DATA:
            where = layout.spread_attempt_of(info.key)
            assert where is not None
            attempts[where].append(info)
        elif kind is KeyKind.TEMPORARY:
            if scan.old(info):
                scan.add(tier, info, "leftover publish temporary")
        elif kind is KeyKind.UPLOAD_MARK:
            _mark_garbage(tier, info, scan, committed_here)
        elif kind is KeyKind.MIGRATED_MARK:
            _migrated_garbage(tier, info, scan, committed_here)
        elif kind is KeyKind.CLOCK_PROBE:
            if scan.old(info):
                scan.add(tier, info, "leftover clock probe")
        elif kind is KeyKind.LEASE:
            lease_infos.append(info)
        elif kind is KeyKind.REPLICA:
            _copy_garbage(tier, info, scan, copies)
    for info in expired_leases(tier, lease_infos, grace=scan.grace):
        scan.add(tier, info, "expired lease")
    for (name, attempt), infos in attempts.items():
        if name not in scan.damaged_names and (name, attempt) not in scan.quarantined:
            _attempt_garbage(tier, scan, name, attempt, infos)


def _attempt_garbage(tier: Tier, scan: _Scan, name: str, attempt: str, infos: list[ObjectInfo]) -> None:
    manifest = scan.referenced.get((name, attempt))
    if manifest is None:
        if not all(scan.old(i) for i in infos):
            return
        try:
            # Un-published by a prune while a load held a lease: the load still reads it.
            if live_leases(tier, name):
                return
        except TierstoreError as err:
            scan.fail(tier, layout.lease_prefix(name), err)
            return
        for info in infos:
            scan.add(tier, info, "attempt named by no manifest")
        return
    try:
        paths = [f.path for f in manifest.files] + [ref.path for ref in manifest.parts]
    except TierstoreError as err:  # a part unreadable or damaged: its files cannot be known
        scan.fail(tier, layout.attempt_prefix(name, attempt), err)
        return
    listed = {tier.file_key(name, attempt, path) for path in paths}
    for info in infos:
        if info.key not in listed and scan.old(info):
            scan.add(tier, info, "file not listed in its manifest")


def _copy_garbage(tier: Tier, info: ObjectInfo, scan: _Scan, copies: set[tuple[str, str]]) -> None:
    """A key of the hot root's replica namespace: garbage once old if its attempt (a copy, a
    parity block, a protection record) was never published there, or no longer is."""
    where = _copy_attempt(info.key)
    if where is None or where in copies or where[0] in scan.damaged_names:
        return  # a manifest of the namespace, or what it publishes
    if scan.old(info):
        scan.add(tier, info, "copy of an attempt this node's replica namespace does not publish")


def _mark_garbage(tier: Tier, info: ObjectInfo, scan: _Scan, committed_here: set[tuple[str, str]]) -> None:
    parsed = layout.parse_upload_key(info.key)
    if parsed is None:
        if scan.old(info):
            scan.add(tier, info, "damaged upload mark")
        return
    name, attempt, rank, failed = parsed
    if name in scan.damaged_names:
        return
    if (name, attempt) in committed_here:
        scan.add(tier, info, "upload mark of a committed checkpoint")
    elif (name, attempt) not in scan.referenced:
        if scan.old(info):
            scan.add(tier, info, "upload mark of a dead attempt")
    elif scan.old(info):
        try:
            damaged = marks.is_damaged(tier, name, attempt, rank, failed=failed, key=info.key)
        except TierstoreError as err:
            scan.fail(tier, info.key, err)
            return
        if damaged:
            scan.add(tier, info, "damaged upload mark")


def _migrated_garbage(
    tier: Tier, info: ObjectInfo, scan: _Scan, committed_here: set[tuple[str, str]]
) -> None:
    parsed = layout.parse_migrated_key(info.key)
    if parsed is None:
        return  # not a mark tierstore writes: not ours to judge
    name, attempt, _ = parsed  # marks for any cold tier, legacy ones too
    if (name, attempt) not in committed_here and name not in scan.damaged_names:
        scan.add(tier, info, "migrated mark of a pruned checkpoint")


def _copy_attempt(key: str) -> tuple[str, str] | None:
    """The ``(name, attempt)`` a key of a hot root's replica namespace belongs to: a copy, a
    parity block, or a protection record (``None`` for its manifests)."""
    rel = key[len(layout.REPLICA_DIR) + 1 :]
    where = layout.spread_attempt_of(rel)
    if where is None and rel.startswith("protection/") and rel.endswith(".json"):
        parts = rel[: -len(".json")].split("/")
        where = (parts[1], parts[2]) if len(parts) == 3 else None
    return where


def _still_unpublished(tier: Tier, keys: list[str]) -> list[str]:
    """Of a hot tier's ``keys``, those whose attempt its replica namespace still does not
    publish (copies, and the node's own files, which that manifest references too): a second
    look just before deleting, as a round or a restore may have published the attempt since
    the scan (docs/design.md invariant 19)."""
    if tier.role != "hot":
        return keys
    published = {(m.name, m.attempt) for m in peer_tier(tier).manifests()}
    if not published:
        return keys
    kept = []
    for key in keys:
        own = layout.spread_attempt_of(key)
        if own is not None and own in published:
            continue
        if layout.kind_of(key) is KeyKind.REPLICA and _copy_attempt(key) in published:
            continue
        kept.append(key)
    return kept


def _delete(tier: Tier, keys: list[str], scan: _Scan) -> None:
    """Delete ``keys`` in batches; a batch that fails is retried key by key, so each failure
    names its key (a batch delete is idempotent, so a retry is always safe)."""
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        try:
            tier.backend.delete_many(batch)
        except TierstoreError:
            for key in batch:
                try:
                    tier.backend.delete(key)
                except TierstoreError as err:
                    scan.fail(tier, key, err)


def find_garbage(
    store: Store | TierURL, *, grace: float = DEFAULT_GRACE, now: float | None = None
) -> list[Garbage]:
    """Everything :func:`collect_garbage` would delete (nothing is touched)."""
    now = time.time() if now is None else now
    tiers = Store.of(store).tiers
    return _scan(tiers, now, grace)[0].garbage


def collect_garbage(
    store: Store | TierURL,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = True,
    now: float | None = None,
) -> GCReport:
    """Find garbage in every tier and, unless ``dry_run``, delete it (see the module docstring
    for what is kept and what the report lists)."""
    now = time.time() if now is None else now
    tiers = Store.of(store).tiers
    scan, damaged = _scan(tiers, now, grace)
    by_label = {t.label: t for t in tiers}
    aborted: list[str] = []
    for tier in tiers:
        try:
            aborted += tier.backend.abort_stale_uploads(older_than=grace, dry_run=dry_run, now=now)
        except TierstoreError as err:
            scan.fail(tier, "", err)
    if not dry_run:
        faults.point("gc.after_scan")  # decided from the scan, nothing deleted yet
        doomed: dict[str, list[str]] = defaultdict(list)
        for item in scan.garbage:
            doomed[item.tier].append(item.key)
        with ThreadPoolExecutor(max(1, len(doomed)), thread_name_prefix="tierstore-gc") as pool:
            list(
                pool.map(
                    lambda label: _delete(
                        by_label[label], _still_unpublished(by_label[label], doomed[label]), scan
                    ),
                    doomed,
                )
            )
        if scan.garbage:
            log.info(
                "garbage collected %d objects (%d bytes)",
                len(scan.garbage),
                sum(g.size for g in scan.garbage),
            )
    return GCReport(
        garbage=tuple(scan.garbage),
        deleted=not dry_run,
        aborted_uploads=tuple(aborted),
        damaged=tuple(damaged),
        failures=tuple(scan.failures),
    )
