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
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from tierstore.errors import (
    CheckpointExists,
    CheckpointNotFound,
    IntegrityError,
    ObjectNotFound,
    PublishConflict,
    TierstoreError,
)
from tierstore.format import layout
from tierstore.format.manifest import MAX_MANIFEST_BYTES, Manifest
from tierstore.lifecycle.prune import delete_data
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["Quarantined", "quarantine", "list_quarantined", "delete_quarantined", "restore_quarantined"]

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
    try:
        tier.backend.publish(key, json.dumps(body).encode())
    except PublishConflict:
        pass  # quarantined before (a crash after the record, or another rank's job)
    done = tier.unpublish(manifest)
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


def _read(tier: Tier, key: str) -> Quarantined | None:
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
        return Quarantined(name, attempt, None, tier.label, f"the record is unreadable ({err})", 0.0, 0, key)
    return Quarantined(
        name, attempt, manifest.step, tier.label, reason, when, manifest.total_size, key, manifest
    )


def list_quarantined(store: Store | TierURL) -> list[Quarantined]:
    """Every quarantined attempt in every tier of ``store``, oldest step first. One listing
    per tier and a read per record; an unreadable record is listed with that reason."""
    found = []
    for tier in Store.of(store).tiers:
        for info in tier.backend.list(layout.quarantine_prefix()):
            record = _read(tier, info.key)
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
    else names it once the record is gone). Returns what was (or would be) removed."""
    chosen = _matching(store, name, attempt)
    if dry_run:
        return [q for _, q in chosen]
    for tier, record in chosen:
        if record.manifest is not None:
            delete_data(tier, record.manifest)
        tier.backend.delete(record.key)
        log.info(
            "removed quarantined checkpoint %s (attempt %s) from %s", record.name, record.attempt, tier.label
        )
    return [q for _, q in chosen]


def restore_quarantined(store: Store | TierURL, name: str, attempt: str | None = None) -> list[Quarantined]:
    """Publish a quarantined checkpoint again (its recorded manifest, exclusively) and drop
    its record: for damage that proved not to be real (a tier that was briefly wrong). A
    name committed again since is never overwritten: :class:`CheckpointExists`."""
    chosen = _matching(store, name, attempt)
    for tier, record in chosen:
        if record.manifest is None:
            raise IntegrityError(
                f"cannot restore: {record.reason}", key=record.key, tier=tier.label, checkpoint=name
            )
        try:
            tier.publish_manifest(record.manifest)
        except CheckpointExists:
            raise CheckpointExists(
                "cannot restore the quarantined attempt: the name is "
                "committed again (another attempt); delete it instead",
                checkpoint=name,
                tier=tier.label,
            ) from None
        tier.backend.delete(record.key)
        log.warning("restored quarantined checkpoint %s (attempt %s) in %s", name, record.attempt, tier.label)
    return [q for _, q in chosen]
