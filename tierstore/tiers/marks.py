"""The marks migration leaves in the tiers, and the cold tier's identity.

Migration keeps no state of its own: the tiers hold it (docs/design.md invariant 12).

* **Store identity** (cold tier): ``tierstore-store.json``, published once at the root by
  the first migrator that commits there. It tells one cold tier from another, so a hot
  tier re-pointed at a new (or mistyped) bucket does not believe that bucket holds what an
  earlier cold tier held.
* **Upload marks** (cold tier): ``rank-<r>.json`` says rank ``r`` uploaded and verified its
  files of one attempt; ``rank-<r>.failed.json`` says its upload failed (so the coordinator
  stops waiting). Marks are hints: a damaged or wrong mark is repaired, never trusted, and
  the cold commit checks every file in place whatever the marks say. Once the cold manifest
  is published the marks of that attempt are cleared (what a crash leaves, GC removes).
* **Migrated marks** (hot tier): ``migrated/<name>/<attempt>/<store-id>.json`` says the
  attempt was committed in that cold tier, even if its policy pruned it there since.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from tierstore.commit import layout
from tierstore.commit.manifest import FileEntry, Manifest
from tierstore.errors import (
    IntegrityError,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    TierstoreError,
)
from tierstore.tiers.tier import Tier

__all__ = [
    "store_id",
    "in_place",
    "read_upload_mark",
    "publish_upload_mark",
    "already_uploaded",
    "rank_uploaded",
    "clear_upload_marks",
    "read_failure",
    "publish_failure",
    "clear_failure",
    "is_damaged",
    "mark_migrated",
    "was_migrated",
    "clear_migrated_marks",
]

log = logging.getLogger(__name__)

_MARK_LIMIT = 64 << 20  # a mark lists one rank's files: generous, but bounded
_SMALL_LIMIT = 1 << 20


# -- store identity --------------------------------------------------------------------------


def store_id(tier: Tier, *, create: bool = False) -> str | None:
    """The identity of ``tier`` (a cold tier); with ``create``, publish one if it has none.

    Raises :class:`~tierstore.errors.IntegrityError` if the identity object is damaged
    (nothing can then be proved about what the tier holds) and storage errors as they come.
    """
    # Read every time (one small GET): a cold tier wiped and re-created under the same URL
    # gets a new identity, and marks for the old one must stop counting at once. The value
    # is kept on the Tier only for callers that may send no request (the manager before a save).
    found = _read_store_id(tier)
    if found is None and create:
        body = json.dumps({"store_id": layout.new_store_id(), "created": time.time()}).encode()
        try:
            tier.backend.publish(layout.STORE_ID_KEY, body)
        except PublishConflict:
            pass  # another migrator named the tier first: theirs is the identity
        found = _read_store_id(tier)
    tier._store_id = found  # type: ignore[attr-defined]
    return found


def _read_store_id(tier: Tier) -> str | None:
    try:
        data = tier.backend.read_bytes(layout.STORE_ID_KEY, limit=_SMALL_LIMIT)
    except ObjectNotFound:
        return None
    try:
        return layout.check_store_id(json.loads(data)["store_id"])
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise IntegrityError(f"the tier's identity object is damaged: {err}",
                             key=layout.STORE_ID_KEY, tier=tier.label) from err


# -- upload marks (cold tier) ----------------------------------------------------------------


def in_place(tier: Tier, name: str, attempt: str, entry: FileEntry) -> bool:
    """Is ``entry`` stored in ``tier`` with its size (and CRC32C, where the store keeps one)?"""
    try:
        info = tier.backend.stat(tier.file_key(name, attempt, entry.path))
    except ObjectNotFound:
        return False
    return info.size == entry.size and info.crc32c in (None, entry.crc32c)


def _mark_body(rank: int, files: tuple[FileEntry, ...]) -> bytes:
    entries = [{"path": f.path, "size": f.size, "crc32c": f.crc32c, "rank": f.rank} for f in files]
    return json.dumps({"rank": rank, "files": entries}, sort_keys=True).encode()


def _sorted(files: Any) -> tuple[FileEntry, ...]:
    return tuple(sorted(files, key=lambda f: (f.rank, f.path)))


def read_upload_mark(tier: Tier, name: str, attempt: str, rank: int) -> tuple[FileEntry, ...] | None:
    """The files rank ``rank``'s mark lists, ``None`` if there is no mark.

    A mark that cannot be read, is too large, or names another rank or files of another
    rank raises :class:`~tierstore.errors.IntegrityError` naming it: callers repair it.
    """
    key = layout.upload_mark_key(name, attempt, rank)
    try:
        data = tier.backend.read_bytes(key, limit=_MARK_LIMIT)
    except ObjectNotFound:
        return None
    except ObjectTooLarge as err:
        raise IntegrityError(f"upload mark is damaged: {err}", key=key, tier=tier.label,
                             checkpoint=name, rank=rank) from err
    try:
        body = json.loads(data)
        files = _sorted(FileEntry(**f) for f in body["files"])
        if body["rank"] != rank or any(f.rank != rank for f in files):
            raise ValueError(f"it names rank {body['rank']!r}")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise IntegrityError(f"upload mark is damaged: {err}", key=key, tier=tier.label,
                             checkpoint=name, rank=rank) from err
    return files


def publish_upload_mark(tier: Tier, name: str, attempt: str, rank: int,
                        files: tuple[FileEntry, ...]) -> None:
    """Publish rank ``rank``'s mark; an equal one already there is success, a damaged or
    different one (ranks only ever mark exactly their own files) is replaced, with a warning."""
    key = layout.upload_mark_key(name, attempt, rank)
    files = _sorted(files)
    body = _mark_body(rank, files)
    for _ in range(3):
        try:
            tier.backend.publish(key, body)
            return
        except PublishConflict:
            try:
                if read_upload_mark(tier, name, attempt, rank) == files:
                    return  # ours, or an identical one from another migrator
                problem = "lists other files"
            except IntegrityError as err:
                problem = str(err)
            log.warning("replacing upload mark %s in %s: %s", key, tier.label, problem)
            tier.backend.delete(key)
    raise PublishConflict("upload mark keeps changing under us", key=key, tier=tier.label)


def already_uploaded(tier: Tier, name: str, attempt: str, rank: int, files: tuple[FileEntry, ...]) -> bool:
    """Did an earlier migrator upload exactly ``files`` for ``rank``, and are they still there?
    A damaged mark is no proof: the rank uploads again (and publishes a good one)."""
    try:
        marked = read_upload_mark(tier, name, attempt, rank)
    except IntegrityError as err:
        log.warning("re-uploading rank %d of %s: %s", rank, name, err)
        return False
    return marked == _sorted(files) and all(in_place(tier, name, attempt, e) for e in files)


def rank_uploaded(tier: Tier, manifest: Manifest, rank: int) -> bool:
    """Has ``rank`` uploaded its files of ``manifest``? Its mark says so; a damaged or wrong
    mark is repaired when every file it should vouch for is in place, and raises
    :class:`~tierstore.errors.IntegrityError` naming the rank (for ``tierstore migrate`` to
    upload again) when not."""
    expected = manifest.files_of_rank(rank)
    try:
        marked = read_upload_mark(tier, manifest.name, manifest.attempt, rank)
    except IntegrityError as err:
        problem = str(err)
    else:
        if marked is None:
            return False
        if marked == expected:
            return True
        problem = "it lists other files than the manifest"
    if not all(in_place(tier, manifest.name, manifest.attempt, e) for e in expected):
        raise IntegrityError(
            f"upload mark is wrong ({problem}) and the rank's files are not all in the "
            "cold tier; `tierstore migrate` uploads them again",
            checkpoint=manifest.name, rank=rank, tier=tier.label)
    log.warning("repairing the upload mark of rank %d of %s in %s: %s", rank,
                manifest.name, tier.label, problem)
    publish_upload_mark(tier, manifest.name, manifest.attempt, rank, expected)
    return True


def clear_upload_marks(tier: Tier, name: str, attempt: str) -> None:
    """Delete every upload and failure mark of an attempt (they did their job: the cold
    manifest commits it now, or the attempt is gone)."""
    for info in list(tier.backend.list(layout.upload_prefix(name, attempt))):
        tier.backend.delete(info.key)


def _failure_body(tier: Tier, key: str) -> dict[str, Any] | None:
    """A failure mark's body, ``None`` if there is none; :class:`IntegrityError` if damaged."""
    try:
        data = tier.backend.read_bytes(key, limit=_SMALL_LIMIT)
    except ObjectNotFound:
        return None
    except ObjectTooLarge as err:
        raise IntegrityError(f"failure mark is damaged: {err}", key=key, tier=tier.label) from err
    try:
        body = json.loads(data)  # RecursionError: deeply nested (valid) JSON, a hostile mark
    except (ValueError, RecursionError) as err:
        raise IntegrityError(f"failure mark is damaged: {err}", key=key, tier=tier.label) from err
    if not isinstance(body, dict):
        raise IntegrityError("failure mark is damaged: not a JSON object", key=key, tier=tier.label)
    return body


def read_failure(tier: Tier, name: str, attempt: str, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s failure mark, ``None`` if there is none."""
    key = layout.failed_mark_key(name, attempt, rank)
    try:
        return _failure_body(tier, key)
    except TierstoreError:  # damaged or unreadable: still a failure, the coordinator stops waiting
        return {"error": f"unreadable failure mark {key}"}


def publish_failure(tier: Tier, name: str, attempt: str, rank: int, file: str | None,
                    error: str) -> None:
    """Best effort: the cold tier may be what is failing (the coordinator then times out)."""
    body = json.dumps({"rank": rank, "file": file, "error": error}).encode()
    key = layout.failed_mark_key(name, attempt, rank)
    try:
        tier.backend.delete(key)  # an older failure's mark: this one is news
        tier.backend.publish(key, body)
    except TierstoreError:
        pass


def clear_failure(tier: Tier, name: str, attempt: str, rank: int) -> None:
    tier.backend.delete(layout.failed_mark_key(name, attempt, rank))


def is_damaged(tier: Tier, name: str, attempt: str, rank: int, *, failed: bool) -> bool:
    """Whether rank ``rank``'s upload mark (``failed``: its failure mark) is there and damaged:
    unreadable, oversized, not what a mark holds, or naming another rank. Storage errors
    other than those propagate (nothing is known then)."""
    if not failed:
        try:
            read_upload_mark(tier, name, attempt, rank)
        except IntegrityError:  # every damage, deep JSON included, comes out as this
            return True
        return False
    try:
        body = _failure_body(tier, layout.failed_mark_key(name, attempt, rank))
    except IntegrityError:
        return True
    return body is not None and body.get("rank") != rank


# -- migrated marks (hot tier) ---------------------------------------------------------------


def mark_migrated(hot: Tier, manifest: Manifest, cold_id: str) -> None:
    """Record in the hot tier that ``manifest`` is committed in the cold tier ``cold_id``.

    Without it, a checkpoint the cold policy later prunes would look pending again (hot
    manifest, no cold manifest): hot pruning would keep it forever and a migrator would
    upload it again. Best effort: if it is lost, the next status check rewrites it.
    """
    key = layout.migrated_key(manifest.name, manifest.attempt, cold_id)
    try:
        hot.backend.publish(key, json.dumps({"store_id": cold_id, "marked": time.time()}).encode())
    except PublishConflict:
        pass
    except TierstoreError as err:
        log.warning("could not mark %s as migrated in %s: %s", manifest.name, hot.label, err)


def was_migrated(hot: Tier, manifest: Manifest, cold_id: str | None) -> bool:
    """Whether the hot tier records ``manifest`` as committed in the cold tier ``cold_id``.

    A mark for another cold tier, or one from before marks named their tier, does not count.
    """
    if cold_id is None:
        return False
    return hot.backend.exists(layout.migrated_key(manifest.name, manifest.attempt, cold_id))


def clear_migrated_marks(hot: Tier, name: str, attempt: str) -> None:
    """Delete the migrated marks of an attempt, for every cold tier they name."""
    for info in list(hot.backend.list(layout.migrated_prefix(name, attempt))):
        hot.backend.delete(info.key)
