"""The marks migration leaves in the tiers, and the cold tier's identity.

Migration keeps no state of its own: the tiers hold it (docs/design.md invariant 12).

* **Store identity** (cold tier): ``tierstore-store.json``, published once at the root by
  the first migrator that commits there. It tells one cold tier from another, so a hot
  tier re-pointed at a new (or mistyped) bucket does not believe that bucket holds what an
  earlier cold tier held.
* **Upload marks** (cold tier): ``rank-<r>/<digest>.<versions>.json`` says rank ``r``
  uploaded and verified its files of one attempt, the files ``<digest>`` names
  (:func:`files_digest`), and that the objects it verified are the stored versions
  ``<versions>`` names (:func:`versions_digest`; ``rank-<r>/<digest>.json`` where the
  backend reports no versions);
  ``rank-<r>.failed.json`` says its upload failed (so the coordinator stops waiting). As
  the key names the content, one listing of the attempt's marks tells the coordinator which
  ranks are done (:func:`list_marks`), with no mark read: a request per 1,000 ranks, not two
  per rank. Marks are hints: a damaged one is replaced, never trusted, and the cold commit
  checks every file's presence and size from a listing whatever the marks say
  (:func:`check_in_place`), and its bytes by the listing's CRC32C where the store lists one
  (GCS), else by the versions: a file listed with another version than its rank verified
  (replaced since, by anyone) is verified again, by the store's CRC32C or by reading it
  back, before anything vouches for it (docs/design.md invariant 10). A mark of an earlier
  version (``rank-<r>.json``, no digest) counts for nothing: ``tierstore migrate`` redoes
  that rank, skipping its verified copies. Once the
  cold manifest is published the marks of that attempt are cleared in a batch (what a crash
  leaves, GC removes).
* **Migrated marks** (hot tier): ``migrated/<name>/<attempt>/<store-id>.json`` says the
  attempt was committed in that cold tier, even if its policy pruned it there since.

Why one module of about 470 lines: the marks are one protocol. When an upload mark counts
depends on its name, the identity and the failure marks, and a change to one must be read
against the others.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierstore.errors import (
    IntegrityError,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
    TierstoreError,
)
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers.tier import Tier

__all__ = [
    "store_id",
    "files_digest",
    "versions_digest",
    "upload_mark_key",
    "MarkListing",
    "list_marks",
    "in_place",
    "not_in_place",
    "check_in_place",
    "read_upload_mark",
    "publish_upload_mark",
    "already_uploaded",
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
    tier.store_id = found
    return found


def _read_store_id(tier: Tier) -> str | None:
    try:
        data = tier.backend.read_bytes(layout.STORE_ID_KEY, limit=_SMALL_LIMIT)
    except ObjectNotFound:
        return None
    try:
        return layout.check_store_id(json.loads(data)["store_id"])
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise IntegrityError(
            f"the tier's identity object is damaged: {err}", key=layout.STORE_ID_KEY, tier=tier.label
        ) from err


# -- upload marks (cold tier) ----------------------------------------------------------------


def files_digest(files: Iterable[FileEntry]) -> str:
    """16 hex digits naming a rank's files: their sorted (path, size, CRC32C)."""
    entries = sorted((f.path, f.size, f.crc32c) for f in files)
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def versions_digest(files: Iterable[FileEntry], versions: Mapping[str, str | None]) -> str | None:
    """16 hex digits naming the stored objects a rank verified: each file's path and the
    version (:attr:`~tierstore.storage.backend.ObjectInfo.version`) of the object it
    checked; ``None`` if the backend gave no version for one of them."""
    pairs = []
    for f in files:
        version = versions.get(f.path)
        if version is None:
            return None
        pairs.append((f.path, version))
    return hashlib.sha256(json.dumps(sorted(pairs)).encode()).hexdigest()[:16]


def upload_mark_key(
    name: str,
    attempt: str,
    rank: int,
    files: Iterable[FileEntry],
    versions: Mapping[str, str | None] | None = None,
) -> str:
    """Where rank ``rank``'s mark for exactly ``files`` (stored as ``versions``) lives: its
    key names its content, so a listing alone says which ranks are done (a mark for other
    files has another key) and which stored objects they verified."""
    files = tuple(files)
    return layout.upload_mark_key(
        name, attempt, rank, files_digest(files), versions_digest(files, versions) if versions else None
    )


@dataclass(frozen=True)
class MarkListing:
    """What one listing of an attempt's upload prefix shows: the digests each rank's marks
    name (and the versions digests beside them), the ranks with a failure mark, and every
    key there (to clear them in a batch)."""

    digests: Mapping[int, frozenset[str]]
    failed: frozenset[int]
    keys: tuple[str, ...]
    versions: Mapping[tuple[int, str], frozenset[str]] = field(default_factory=dict)

    def marked(self, rank: int, digest: str) -> bool:
        return digest in self.digests.get(rank, frozenset())

    def vouches(self, rank: int, digest: str, versions: str | None) -> bool:
        """Whether a mark of ``rank`` for the files ``digest`` names verified exactly the
        stored objects ``versions`` names."""
        return versions is not None and versions in self.versions.get((rank, digest), frozenset())


def list_marks(tier: Tier, name: str, attempt: str) -> MarkListing:
    """One listing of the attempt's marks (a request per 1,000 keys on an object store); no
    mark is read. Marks of earlier versions (no digest in the key) count for no rank."""
    digests: dict[int, set[str]] = {}
    versions: dict[tuple[int, str], set[str]] = {}
    failed: set[int] = set()
    keys: list[str] = []
    for info in tier.backend.list(layout.upload_prefix(name, attempt)):
        keys.append(info.key)
        parsed = layout.parse_upload_key(info.key)
        digest = layout.upload_mark_digest(info.key)
        if parsed is not None and parsed[3]:
            failed.add(parsed[2])
        elif parsed is not None and digest is not None:
            digests.setdefault(parsed[2], set()).add(digest)
            verified = layout.upload_mark_versions(info.key)
            if verified is not None:
                versions.setdefault((parsed[2], digest), set()).add(verified)
    return MarkListing(
        {rank: frozenset(d) for rank, d in digests.items()},
        frozenset(failed),
        tuple(keys),
        {k: frozenset(v) for k, v in versions.items()},
    )


def in_place(tier: Tier, name: str, attempt: str, entry: FileEntry) -> bool:
    """Is ``entry`` stored in ``tier`` with its size (and CRC32C, where the store keeps one)?"""
    try:
        info = tier.backend.stat(tier.file_key(name, attempt, entry.path))
    except ObjectNotFound:
        return False
    return info.size == entry.size and info.crc32c in (None, entry.crc32c)


def not_in_place(tier: Tier, name: str, attempt: str, files: Iterable[FileEntry]) -> list[FileEntry]:
    """The ``files`` that ``tier`` lacks, or holds with another size (or CRC32C, where a
    listing shows one): :func:`check_in_place` without the listing."""
    return check_in_place(tier, name, attempt, files)[0]


def check_in_place(
    tier: Tier, name: str, attempt: str, files: Iterable[FileEntry]
) -> tuple[list[FileEntry], dict[str, ObjectInfo]]:
    """The ``files`` that ``tier`` lacks or holds with another size (or CRC32C, where a
    listing shows one), and what the listing showed of each file present (by its path),
    from one listing per data prefix of the attempt (one prefix, or the attempt's hashed
    prefixes on a backend with ``spread_keys``), not a request per file.

    What this proves alone: every file is there, at its size, now. Its bytes are proved by
    a listed CRC32C (GCS), or by a listed version equal to the one its rank verified at
    upload (:meth:`MarkListing.vouches`); the cold commit verifies any other file again.
    """
    keyed = [(tier.file_key(name, attempt, f.path), f) for f in files]
    listed: dict[str, ObjectInfo] = {}
    for prefix in sorted({_data_prefix(key, f.path) for key, f in keyed}):
        listed.update((info.key, info) for info in tier.backend.list(prefix))
    absent, found = [], {}
    for key, f in keyed:
        info = listed.get(key)
        if info is None or info.size != f.size or info.crc32c not in (None, f.crc32c):
            absent.append(f)
        else:
            found[f.path] = info
    return absent, found


def _data_prefix(key: str, path: str) -> str:
    """The attempt's prefix ``key`` lives under: the key less the file's relative path."""
    if key.endswith("/" + path):
        return key[: len(key) - len(path)]
    return key.rsplit("/", 1)[0] + "/"


def _mark_body(
    rank: int, files: tuple[FileEntry, ...], versions: Mapping[str, str | None] | None = None
) -> bytes:
    entries = [{"path": f.path, "size": f.size, "crc32c": f.crc32c, "rank": f.rank} for f in files]
    body: dict[str, Any] = {"rank": rank, "files": entries}
    if versions:  # for people reading the store: the key is what counts
        body["versions"] = {f.path: versions.get(f.path) for f in files}
    return json.dumps(body, sort_keys=True).encode()


def _sorted(files: Any) -> tuple[FileEntry, ...]:
    return tuple(sorted(files, key=lambda f: (f.rank, f.path)))


def read_upload_mark(
    tier: Tier, name: str, attempt: str, rank: int, files: Iterable[FileEntry] | None = None
) -> tuple[FileEntry, ...] | None:
    """The files rank ``rank``'s mark for ``files`` lists, ``None`` if there is no such mark.
    Without ``files``: whichever mark of the rank one listing of its marks finds first.

    A mark that cannot be read, is too large, names another rank or files of another rank,
    or lists other files than its key names raises :class:`~tierstore.errors.IntegrityError`
    naming it: callers repair it.
    """
    for key in _rank_marks(tier, name, attempt, rank, files):
        return _read_mark(tier, key, name, rank)
    return None


def _rank_marks(
    tier: Tier, name: str, attempt: str, rank: int, files: Iterable[FileEntry] | None = None
) -> list[str]:
    """Keys of rank ``rank``'s marks (for exactly ``files``, if given): one listing."""
    digest = files_digest(files) if files is not None else None
    return [
        info.key
        for info in tier.backend.list(layout.rank_marks_prefix(name, attempt, rank))
        if (found := layout.upload_mark_digest(info.key)) is not None and digest in (None, found)
    ]


def _read_mark(tier: Tier, key: str, name: str, rank: int) -> tuple[FileEntry, ...] | None:
    try:
        data = tier.backend.read_bytes(key, limit=_MARK_LIMIT)
    except ObjectNotFound:
        return None
    except ObjectTooLarge as err:
        raise IntegrityError(
            f"upload mark is damaged: {err}", key=key, tier=tier.label, checkpoint=name, rank=rank
        ) from err
    try:
        body = json.loads(data)
        files = _sorted(FileEntry(**f) for f in body["files"])
        if body["rank"] != rank or any(f.rank != rank for f in files):
            raise ValueError(f"it names rank {body['rank']!r}")
        digest = layout.upload_mark_digest(key)
        if digest is not None and digest != files_digest(files):
            raise ValueError("it lists other files than its key names")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise IntegrityError(
            f"upload mark is damaged: {err}", key=key, tier=tier.label, checkpoint=name, rank=rank
        ) from err
    return files


def publish_upload_mark(
    tier: Tier,
    name: str,
    attempt: str,
    rank: int,
    files: tuple[FileEntry, ...],
    versions: Mapping[str, str | None] | None = None,
) -> None:
    """Publish rank ``rank``'s mark for ``files``, which it verified stored as ``versions``
    (path -> :attr:`ObjectInfo.version`); an equal one already there is success, a damaged
    one (its key names these very files) is replaced, with a warning."""
    files = _sorted(files)
    key = upload_mark_key(name, attempt, rank, files, versions)
    body = _mark_body(rank, files, versions)
    for _ in range(3):
        try:
            tier.backend.publish(key, body)
            return
        except PublishConflict:
            try:
                if _read_mark(tier, key, name, rank) == files:
                    return  # ours, or an identical one from another migrator
                problem = "lists other files"
            except IntegrityError as err:
                problem = str(err)
            log.warning("replacing upload mark %s in %s: %s", key, tier.label, problem)
            tier.backend.delete(key)
    raise PublishConflict("upload mark keeps changing under us", key=key, tier=tier.label)


def already_uploaded(tier: Tier, name: str, attempt: str, rank: int, files: tuple[FileEntry, ...]) -> bool:
    """Did an earlier migrator upload and verify exactly ``files`` for ``rank``, and are the
    very objects it verified still there (same versions, now)? A damaged mark, a mark that
    names no versions, or a file replaced since is no proof: the rank's files are then
    checked one by one (and what is not intact is uploaded again)."""
    keys = _rank_marks(tier, name, attempt, rank, files)
    verified = {v for key in keys if (v := layout.upload_mark_versions(key)) is not None}
    if not verified:
        return False
    try:
        if _read_mark(tier, keys[0], name, rank) != _sorted(files):
            return False
    except IntegrityError as err:
        log.warning("re-checking rank %d of %s: %s", rank, name, err)
        return False
    now: dict[str, str | None] = {}
    for entry in files:
        try:
            info = tier.backend.stat(tier.file_key(name, attempt, entry.path))
        except ObjectNotFound:
            return False
        if info.size != entry.size or info.crc32c not in (None, entry.crc32c):
            return False
        now[entry.path] = info.version
    return versions_digest(files, now) in verified


def clear_upload_marks(tier: Tier, name: str, attempt: str, keys: Iterable[str] | None = None) -> None:
    """Delete every upload and failure mark of an attempt (they did their job: the cold
    manifest commits it now, or the attempt is gone), in batches; ``keys``: the ones a
    listing just showed, so as not to list again."""
    if keys is None:
        keys = [info.key for info in tier.backend.list(layout.upload_prefix(name, attempt))]
    tier.backend.delete_many(list(keys))


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


def publish_failure(tier: Tier, name: str, attempt: str, rank: int, file: str | None, error: str) -> None:
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


def is_damaged(
    tier: Tier, name: str, attempt: str, rank: int, *, failed: bool, key: str | None = None
) -> bool:
    """Whether rank ``rank``'s upload mark at ``key`` (default: the key earlier versions
    used; ``failed``: its failure mark) is there and damaged: unreadable, oversized, not what
    a mark holds, naming another rank, or other files than its key names. Storage errors
    other than those propagate (nothing is known then)."""
    if not failed:
        try:
            _read_mark(tier, key or layout.upload_mark_key(name, attempt, rank), name, rank)
        except IntegrityError:  # every damage, deep JSON included, comes out as this
            return True
        return False
    try:
        body = _failure_body(tier, key or layout.failed_mark_key(name, attempt, rank))
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
