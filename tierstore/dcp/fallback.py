"""Reading one file of a checkpoint from the nearest tier whose copy verifies, falling back
tier by tier, and what counts as damage (docs/design.md invariant 5).

Damage is proven before it is reported (issue 34): a resume falls back past a checkpoint it
calls damaged and quarantines it, so one failed read must not decide. When every tier
failed, each is read once more, and a file counts as missing only when the second request
answers 404 too and the tier's listing does not show it. Damage in some tiers and another
failure in others is not damage: that failure is raised, and nothing steps back past the
checkpoint. :class:`~tierstore.dcp.reader.TieredReader` reads every data file and
``.metadata`` through :func:`read_nearest`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tierstore.dcp.failures import causes
from tierstore.errors import (
    ChecksumMismatch,
    IntegrityError,
    ObjectNotFound,
    ObjectTooLarge,
    StorageError,
    TierstoreError,
    TransientStorageError,
    UnsafePath,
)
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.storage.missing import proven_missing
from tierstore.tiers.tier import Tier

__all__ = ["is_damage", "read_nearest"]

log = logging.getLogger(__name__)

# Errors that mean "this checkpoint's bytes are bad or gone", never "try again later".
_DAMAGE = (IntegrityError, ObjectNotFound, ObjectTooLarge, UnsafePath)

Consume = Callable[[Tier, str], None]  # reads one tier's copy of a file, by its key
Served = Callable[[int, Tier], None]  # told which holder (by its index) served the file


def is_damage(err: BaseException) -> bool:
    """Whether ``err`` (or, for DCP's ``CheckpointException``, every rank's error in it) says
    the checkpoint's stored data is damaged or missing, rather than anything about the
    caller, the state dict or a passing storage failure.
    """
    found = causes(err)
    if found == [err]:
        return isinstance(err, _DAMAGE)
    return bool(found) and all(is_damage(c) for c in found)


def read_nearest(
    manifest: Manifest,
    holders: Sequence[Tier],
    entry: FileEntry,
    consume: Consume,
    *,
    node_local: bool,
    served: Served,
) -> None:
    """Read ``entry`` of ``manifest`` from the nearest of ``holders`` whose copy verifies
    (``consume`` reads one tier's copy), falling back tier by tier; ``served`` is told which
    holder served it. ``node_local``: a file missing from the first holder (this node's hot
    root) is expected, not worth a warning. Raises as the module docstring says."""
    failed = _each_holder(manifest, holders, entry, consume, node_local, served, proving=False)
    if failed is None:
        return
    if all(is_damage(err) for err in failed):
        log.warning(
            "file %s of checkpoint %s failed in every tier holding it; reading it once "
            "more before calling it damaged: %s",
            entry.path,
            manifest.name,
            failed[-1],
        )
        failed = _each_holder(manifest, holders, entry, consume, node_local, served, proving=True)
        if failed is None:
            log.warning(
                "file %s of checkpoint %s read verified on a second try: not damaged",
                entry.path,
                manifest.name,
            )
            return
        if all(is_damage(err) for err in failed):
            # The farthest tier's error, as a read reports it, naming the tiers whose copy
            # failed twice (a quarantine need not read them a third time).
            last = failed[-1]
            labels = tuple(tier.label for tier in holders)
            proven = type(last)(last.message, **{**last.context, "proven_in": labels})
            raise proven from last
    raise next(err for err in failed if not is_damage(err))


def _each_holder(
    manifest: Manifest,
    holders: Sequence[Tier],
    entry: FileEntry,
    consume: Consume,
    node_local: bool,
    served: Served,
    *,
    proving: bool,
) -> list[TierstoreError] | None:
    """One pass of :func:`read_nearest`: ``None`` once a tier served ``entry``, else every
    tier's error, nearest first."""
    errors: list[TierstoreError] = []
    for i, tier in enumerate(holders):
        try:
            _read_from(manifest, tier, entry, consume, proving=proving)
        except (IntegrityError, StorageError) as err:
            errors.append(err)
            if i + 1 == len(holders):
                return errors
            # this node's hot root, and its copies of other nodes' files: a file missing there is expected
            expected = not (node_local and tier.role in ("hot", "peer") and isinstance(err, ObjectNotFound))
            log.log(
                logging.WARNING if expected else logging.DEBUG,
                "falling back to the next tier for file %s of checkpoint %s: %s",
                entry.path,
                manifest.name,
                err,
            )
            continue
        served(i, tier)
        if errors:
            log.info("read %s of checkpoint %s from %s", entry.path, manifest.name, tier.label)
        return None
    return errors


def _read_from(manifest: Manifest, tier: Tier, entry: FileEntry, consume: Consume, *, proving: bool) -> None:
    """Read ``entry`` from ``tier``; on a second try (``proving``), a 404 stands only if
    the object is proven missing (:func:`~tierstore.storage.missing.proven_missing`)."""
    name = manifest.name
    key = tier.file_key(name, manifest.attempt, entry.path)
    try:
        # The stored size first: a truncated file fails fast, and no length claimed by
        # a forged manifest or metadata can make a read allocate more than is stored.
        stored = tier.backend.stat(key).size
        if stored != entry.size:
            raise ChecksumMismatch.size(entry.size, stored, checkpoint=name, file=entry.path, tier=tier.label)
        consume(tier, key)
    except ObjectNotFound as err:  # say whose file: the key alone may be hashed
        context = {"tier": tier.label, **err.context, "checkpoint": name, "file": entry.path}
        if proving and not proven_missing(tier.backend, key):
            raise TransientStorageError(
                "the tier answered 404 for this file twice but still holds it (an eventually "
                "consistent store, or a proxy sending requests astray?): not damage; the load "
                "stops here rather than step back past the checkpoint, try it again",
                **context,
            ) from err
        if proving:
            raise ObjectNotFound(
                f"{err.message} (missing: a second request and the tier's listing agree)", **context
            ) from err
        raise ObjectNotFound(err.message, **context) from err
