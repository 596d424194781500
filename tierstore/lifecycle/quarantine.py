"""Quarantine: a checkpoint a verified load proved damaged is set aside, never kept in place
of a good one (docs/design.md invariant 21).

A resume that falls back past a damaged checkpoint (its ``.metadata`` or a data file missing
or failing its CRC32C in every tier holding it) would otherwise leave it committed: the job
re-trains that step and its save is refused (the name is taken: a restart loop), and
retention counts the damaged checkpoint among the ones it keeps while pruning good ones.
:func:`quarantine` instead, in each tier holding that attempt:

1. publishes a record ``quarantine/<name>/<attempt>.json`` holding the manifest, why, and
   when (an exclusive publish: quarantining twice is harmless);
2. un-publishes the checkpoint (only that attempt's root: :meth:`Tier.unpublish`).

The data stays where it is, named by the record, so ``gc`` keeps it; retention no longer
sees the checkpoint, and a new save of the same step commits as a new attempt. A crash
between the two steps leaves the checkpoint published and recorded: the next load finds it
damaged again and finishes the job. Only a person removes a quarantined checkpoint
(:func:`delete_quarantined`, ``tierstore quarantine --delete NAME``), or puts it back
(:func:`restore_quarantined`: its manifest published again, if the name is free) after
deciding the damage was not real. ``tierstore ls``, ``tierstore status`` and
``CheckpointManager.health()`` show what is quarantined.

Only what is proven damaged is quarantined (issue 34): one failed read is no proof (an
eventually consistent S3-compatible or a misrouting proxy answers a 404 for an object that
is there). :func:`quarantine_proven`, what a resume calls, quarantines a tier's copy only
once :func:`prove_damage` re-checked it there. And a record is never trusted over a
published manifest: a record naming the attempt that is committed now (a ``--restore``
interrupted between its publish and its record delete, a resume quarantining it this
moment, or a record someone planted) never gets that attempt's data deleted;
``--restore`` finishes the interrupted restore (drops the record). Named fault points hold
each step between its check and its act for the crash suite: ``quarantine.after_check``,
``quarantine.after_record``, ``quarantine.restore_after_check``,
``quarantine.restore_after_publish``, ``quarantine.delete_after_check``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tierstore.errors import (
    CheckpointExists,
    CheckpointNotFound,
    ChecksumMismatch,
    IntegrityError,
    InvalidManifest,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    TierstoreError,
    UnsafePath,
)
from tierstore.format import layout
from tierstore.format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from tierstore.format.verified import verify_file
from tierstore.lifecycle.prune import delete_data
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.storage.missing import proven_missing
from tierstore.tiers.marks import not_in_place
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = [
    "Quarantined",
    "quarantine",
    "quarantine_proven",
    "prove_damage",
    "list_quarantined",
    "delete_quarantined",
    "restore_quarantined",
]

log = logging.getLogger(__name__)

_RECORD_LIMIT = MAX_MANIFEST_BYTES + (1 << 16)  # the manifest root, and a few fields


@dataclass(frozen=True)
class Quarantined:
    """One quarantined checkpoint attempt in one tier."""

    name: str
    attempt: str
    step: int | None
    tier: str  # the tier's label
    reason: str
    when: float  # when it was quarantined (the quarantining machine's clock: for people)
    size: int  # bytes its data holds (0 if the record is unreadable)
    key: str
    manifest: Manifest | None = None  # None: the record is unreadable (kept all the same)
    version: str | None = None  # the record's, as listed: a restore drops only this one


def quarantine(tier: Tier, manifest: Manifest, reason: str) -> bool:
    """Set ``manifest``'s checkpoint aside in ``tier`` (module docstring); ``True`` if it is
    un-published now, ``False`` if the name holds another commit (left alone)."""
    key = layout.quarantine_key(manifest.name, manifest.attempt)
    body = {
        "name": manifest.name,
        "attempt": manifest.attempt,
        "step": manifest.step,
        "reason": reason,
        "when": time.time(),
        "manifest": manifest.to_json().decode(),
    }
    record = json.dumps(body).encode()
    _record(tier, key, record)
    faults.point("quarantine.after_record")
    done = tier.unpublish(manifest)
    if done and not tier.backend.exists(key):
        # A `--restore` dropped the record meanwhile, taking it for one an interrupted
        # restore left; un-published now, the data must stay named (gc would take it).
        _record(tier, key, record)
    if done:
        log.error(
            "quarantined checkpoint %s (attempt %s) in %s: %s; its data is kept "
            "(`tierstore quarantine` lists it, `tierstore quarantine --delete %s` "
            "removes it)",
            manifest.name,
            manifest.attempt,
            tier.label,
            reason,
            manifest.name,
        )
    return done


def _record(tier: Tier, key: str, record: bytes) -> None:
    """Publish a quarantine record; one there already (a crash after the record, a restore
    still in flight) is replaced by a fresh version, which that restore's conditional
    delete of the version it read leaves standing."""
    try:
        tier.backend.publish(key, record)
    except PublishConflict:
        tier.backend.delete(key)
        try:
            tier.backend.publish(key, record)
        except PublishConflict:
            pass  # another resume's record of the same attempt: as good as ours


def quarantine_proven(tier: Tier, manifest: Manifest, reason: str, failures: Sequence[BaseException]) -> bool:
    """:func:`quarantine` ``manifest`` (``tier``'s own copy) in ``tier`` if a resume's
    ``failures`` prove it damaged there now (:func:`prove_damage`); ``False`` if not proven
    (it stays published, with a warning) or the name holds another commit."""
    proof = prove_damage(tier, manifest, failures)
    if proof is None:
        log.warning(
            "not quarantining checkpoint %s (attempt %s) in %s: a resume found it damaged, "
            "but its copy there is not proven damaged (what failed reads verified now, or a "
            "404 was not confirmed by a second request and the listing); it stays published",
            manifest.name,
            manifest.attempt,
            tier.label,
        )
        return False
    faults.point("quarantine.after_check")
    return quarantine(tier, manifest, f"{reason}; proven in this tier: {proof}")


# What a read of one file fails with when its stored copy is bad: re-checked in each tier.
_READ_DAMAGE = (ChecksumMismatch, ObjectNotFound, ObjectTooLarge, UnsafePath)


def prove_damage(tier: Tier, manifest: Manifest, failures: Sequence[BaseException]) -> TierstoreError | None:
    """The error proving ``tier``'s copy of ``manifest`` damaged now, ``None`` if not proven.

    ``failures`` are what a load raised (each rank's error). A file that failed to read
    must fail again in this tier: missing only when proven missing (a second request and
    the listing agree), corrupt when a verified read fails (not read a third time where
    the reader read this tier's copy twice already: its error's ``proven_in`` names the
    tier). A manifest part must fail to load again from this tier. Any other damage (DCP's
    metadata that does not unpickle, a file the metadata names and the manifest does not)
    is a fact of the verified bytes every tier shares, and stands. Storage errors other than
    a 404 propagate: a tier that cannot answer proves nothing."""
    damage = [f for f in failures if isinstance(f, (IntegrityError, *_READ_DAMAGE))]
    try:
        for failure in damage:
            if isinstance(failure, _READ_DAMAGE) and failure.file is not None:
                entry = manifest.file(failure.file)  # from this tier's parts
                proven = _proven_read(tier, manifest, entry, failure) if entry is not None else failure
            elif isinstance(failure, InvalidManifest):
                proven = _proven_manifest(manifest, failure)
            else:
                proven = None if isinstance(failure, _READ_DAMAGE) else failure  # no file: unprovable
            if proven is not None:
                return proven
    except InvalidManifest as err:  # a part of this tier's manifest is missing or altered
        return err
    return None


def _proven_read(
    tier: Tier, manifest: Manifest, entry: FileEntry, failure: TierstoreError
) -> TierstoreError | None:
    key = tier.file_key(manifest.name, manifest.attempt, entry.path)
    context = {"checkpoint": manifest.name, "file": entry.path, "tier": tier.label}
    if not isinstance(failure, ObjectNotFound) and tier.label in getattr(failure, "proven_in", ()):
        return failure  # the reader's two verified reads of this very copy failed
    try:
        size = tier.backend.stat(key).size
        if size != entry.size:
            return ChecksumMismatch.size(entry.size, size, **context)
        verify_file(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label)
    except ObjectNotFound as err:
        if not proven_missing(tier.backend, key):
            return None
        return ObjectNotFound(f"missing: a request and the tier's listing agree ({err.message})", **context)
    except (ChecksumMismatch, ObjectTooLarge, UnsafePath) as err:
        return err
    return None


def _proven_manifest(manifest: Manifest, failure: InvalidManifest) -> TierstoreError | None:
    try:
        manifest.files  # noqa: B018  (every part, read from this tier now)
    except InvalidManifest as err:
        return err
    if failure.file is not None and manifest.file(failure.file) is None:
        return failure  # DCP's metadata names a file no copy of the manifest lists
    return None


def _read(tier: Tier, info: ObjectInfo) -> Quarantined | None:
    key = info.key
    parsed = layout.parse_quarantine_key(key)
    if parsed is None:
        return None
    name, attempt = parsed
    try:
        body = json.loads(tier.backend.read_bytes(key, limit=_RECORD_LIMIT))
        manifest = Manifest.from_json(
            str(body["manifest"]).encode(), key=key, tier=tier.label, expect_name=name, loader=tier.read_part
        )
        if manifest.attempt != attempt:
            raise ValueError(f"it records attempt {manifest.attempt}")
        reason, when = str(body.get("reason", "")), float(body.get("when", 0.0))
    except ObjectNotFound:
        return None  # removed meanwhile
    except (TierstoreError, ValueError, KeyError, TypeError, RecursionError) as err:
        why = f"the record is unreadable ({err})"
        return Quarantined(name, attempt, None, tier.label, why, 0.0, 0, key, None, info.version)
    return Quarantined(
        name,
        attempt,
        manifest.step,
        tier.label,
        reason,
        when,
        manifest.total_size,
        key,
        manifest,
        info.version,
    )


def list_quarantined(store: Store | TierURL) -> list[Quarantined]:
    """Every quarantined attempt in every tier of ``store``, oldest step first. One listing
    per tier and a read per record; an unreadable record is listed with that reason."""
    found = []
    for tier in Store.of(store).tiers:
        for info in tier.backend.list(layout.quarantine_prefix()):
            record = _read(tier, info)
            if record is not None:
                found.append(record)
    return sorted(found, key=lambda q: (q.step is None, q.step or 0, q.name, q.attempt, q.tier))


def _matching(store: Store | TierURL, name: str, attempt: str | None) -> list[tuple[Tier, Quarantined]]:
    store = Store.of(store)
    by_label = {tier.label: tier for tier in store.tiers}
    chosen = [
        (by_label[q.tier], q)
        for q in list_quarantined(store)
        if q.name == name and attempt in (None, q.attempt)
    ]
    if not chosen:
        raise CheckpointNotFound(
            "no quarantined checkpoint of that name" + (f" and attempt {attempt}" if attempt else ""),
            checkpoint=name,
            tier=store.label,
        )
    return chosen


def delete_quarantined(
    store: Store | TierURL, name: str, attempt: str | None = None, *, dry_run: bool = False
) -> list[Quarantined]:
    """Remove the quarantined checkpoint ``name`` (one ``attempt``, or all of that name):
    its data, then its record. What an unreadable record names is left to ``gc`` (nothing
    else names it once the record is gone). Returns what was (or would be) removed.

    A record naming the attempt committed now in its tier deletes nothing, anywhere
    (:class:`CheckpointExists`, a dry run included): that data is a live checkpoint's
    (a ``--restore`` interrupted after its publish, which ``--restore`` finishes; a resume
    quarantining it this moment; a planted record)."""
    chosen = _matching(store, name, attempt)
    for tier, record in chosen:
        _refuse_if_live(tier, record)
    if dry_run:
        return [q for _, q in chosen]
    faults.point("quarantine.delete_after_check")
    for tier, record in chosen:
        if record.manifest is not None:
            delete_data(tier, record.manifest)
        tier.backend.delete(record.key)
        log.info(
            "removed quarantined checkpoint %s (attempt %s) from %s", record.name, record.attempt, tier.label
        )
    return [q for _, q in chosen]


def _refuse_if_live(tier: Tier, record: Quarantined) -> None:
    live = tier.find_manifest(record.name)
    if live is None or live.attempt != record.attempt:
        return
    raise CheckpointExists(
        f"refusing to delete quarantined attempt {record.attempt}: it is the checkpoint "
        "committed now, so its data is live (a --restore interrupted after its publish, a "
        "resume quarantining it right now, or a record someone planted); nothing was "
        f"deleted. Run `tierstore quarantine --restore {record.name}` to finish the restore "
        "(it drops the stale record and keeps the checkpoint); if a resume is quarantining "
        "it, run --delete again once it is un-published",
        checkpoint=record.name,
        tier=tier.label,
    )


def restore_quarantined(store: Store | TierURL, name: str, attempt: str | None = None) -> list[Quarantined]:
    """Publish a quarantined checkpoint again (its recorded manifest, exclusively) and drop
    its record: for damage that proved not to be real (a tier that was briefly wrong).

    Its data must be whole first (one listing: every file at its size), else
    :class:`IntegrityError` and nothing published. A name committed again since by
    another attempt is never overwritten: :class:`CheckpointExists`. Where the recorded
    attempt is the one committed now (a restore interrupted between its publish and its
    record delete), only the record is dropped: a re-run finishes the restore."""
    chosen = _matching(store, name, attempt)
    for tier, record in chosen:
        if record.manifest is None:
            raise IntegrityError(
                f"cannot restore: {record.reason}", key=record.key, tier=tier.label, checkpoint=name
            )
        if not _is_live(tier, record.manifest):
            _check_whole(tier, record.manifest)
            faults.point("quarantine.restore_after_check")
            try:
                tier.publish_manifest(record.manifest)
            except CheckpointExists:
                if not _is_live(tier, record.manifest):  # a rival restore of it is fine
                    raise
            faults.point("quarantine.restore_after_publish")
        else:
            log.warning(
                "checkpoint %s (attempt %s) is committed in %s already (a restore interrupted "
                "after its publish): dropping its quarantine record",
                name,
                record.attempt,
                tier.label,
            )
        if _drop(tier, record):
            log.warning(
                "restored quarantined checkpoint %s (attempt %s) in %s", name, record.attempt, tier.label
            )
    return [q for _, q in chosen]


def _drop(tier: Tier, record: Quarantined) -> bool:
    """Delete ``record`` as it was listed; ``False`` if a resume quarantined the attempt again
    meanwhile (a fresh record: it stands)."""
    if record.version is None:  # a backend without versions
        tier.backend.delete(record.key)
        return True
    if tier.backend.delete_if(record.key, record.version):
        return True
    log.error(
        "checkpoint %s (attempt %s) was quarantined again in %s while being restored (a resume "
        "found it damaged): it stays quarantined",
        record.name,
        record.attempt,
        tier.label,
    )
    return False


def _is_live(tier: Tier, manifest: Manifest) -> bool:
    """Whether ``manifest``'s attempt is committed in ``tier`` now; :class:`CheckpointExists`
    if another attempt of its name is."""
    live = tier.find_manifest(manifest.name)
    if live is not None and live.attempt != manifest.attempt:
        raise CheckpointExists(
            f"cannot restore the quarantined attempt {manifest.attempt}: the name is committed "
            f"again by attempt {live.attempt}; delete the quarantined one instead "
            f"(`tierstore quarantine --delete {manifest.name} --attempt {manifest.attempt}`)",
            checkpoint=manifest.name,
            tier=tier.label,
        )
    return live is not None


def _check_whole(tier: Tier, manifest: Manifest) -> None:
    """Refuse to publish a manifest naming data that is gone (a prune that decided before the
    quarantine deleted it, a person): docs/design.md invariant 2."""
    missing = not_in_place(tier, manifest.name, manifest.attempt, manifest.files)
    if missing:
        raise IntegrityError(
            f"cannot restore: {len(missing)} of its {manifest.num_files} files are missing or of "
            "another size; its data is not whole, delete it instead "
            f"(`tierstore quarantine --delete {manifest.name} --attempt {manifest.attempt}`)",
            checkpoint=manifest.name,
            file=missing[0].path,
            tier=tier.label,
        )
