"""Copy one committed checkpoint from a store to another tier (``tierstore cp``), verified.

A copy is a migration whose destination plays the cold role: the migrator's own machinery
(:class:`~tierstore.migration.migrator.Migrator`) streams each file from the source, checks every
byte against the manifest's size and CRC32C as it goes, has the destination's writer check what
it stored, publishes each rank's upload mark in the destination, proves every file in place
there and only then publishes the manifest, last and exclusively (docs/design.md invariants 2,
3, 10 and 12). The destination is a tier in its own right afterwards: ``tierstore ls --hot
<destination>`` lists the checkpoint and ``TieredReader(destination)`` loads it.

What differs from a migration:

* **The source is never changed** (a lease in each source tier while the copy runs aside):
  no migrated mark is written in it. A migrated mark names the cold tier it vouches for, so it
  would not count for the source's own cold tier anyway; not writing it keeps a copy elsewhere
  from ever saying anything about the source's migration (docs/design.md invariant 12).
* **The nearest verified tier**: the source store's tiers holding the checkpoint are tried
  nearest first; a file damaged or missing in one of them makes the copy go on from the next
  one, re-sending only what is not already verified at the destination. With no intact copy
  left, the error names the file, the checkpoint and the tier, and nothing is committed at
  the destination.
* **Resumable, idempotent**: a copy interrupted (Ctrl-C, SIGKILL) leaves uncommitted files
  and marks only; running it again skips each file already verified at the destination. A
  checkpoint the destination already commits (that attempt) is a no-op success; another
  attempt of that name there is :class:`~tierstore.errors.CheckpointExists`, never overwritten.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, cast

from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    ConfigError,
    ObjectNotFound,
    TierstoreError,
)
from tierstore.format.manifest import Manifest
from tierstore.migration.jobs import Job, JobFailed, MigrationOptions, MigrationState, files_by_rank
from tierstore.migration.migrator import Migrator
from tierstore.progress import ProgressCallback
from tierstore.storage import faults
from tierstore.storage.backend import Backend
from tierstore.tiers import leases, marks
from tierstore.tiers.catalog import resolve
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["copy_checkpoint", "CopyReport"]

log = logging.getLogger(__name__)

DESTINATION = "destination"  # the role a copy's destination tier is named by in messages


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_checkpoint` did."""

    manifest: Manifest
    source: tuple[str, ...]  # the source tiers copied from (labels), nearest first
    destination: str  # the destination tier's label
    bytes_sent: int  # bytes written to the destination by this call
    files_sent: int  # files written to the destination by this call
    already_there: bool = False  # the destination committed this attempt before: nothing done


def copy_checkpoint(
    source: Store | TierURL,
    destination: Store | TierURL,
    *,
    name: str | None = None,
    step: int | None = None,
    destination_options: dict[str, Any] | None = None,
    config: MigrationOptions | None = None,
    progress: ProgressCallback | None = None,
) -> CopyReport:
    """Copy the committed checkpoint ``name`` (or the newest of ``step``, or the newest) from
    ``source`` to ``destination`` (a URL with ``destination_options``, or a store: its nearest
    tier), verified, the manifest published last (module docstring).

    ``progress(name, bytes_done, bytes_total)`` counts bytes written to the destination and
    files found already there, verified. Raises :class:`~tierstore.errors.CheckpointNotFound`
    (no such checkpoint in the source), :class:`~tierstore.errors.ChecksumMismatch` or
    :class:`~tierstore.errors.ObjectNotFound` (no intact copy of a file in any source tier,
    naming file, checkpoint and tier), :class:`~tierstore.errors.CheckpointExists` (the
    destination commits another attempt of that name) and storage errors as they come.
    """
    config = config or MigrationOptions()
    store = Store.of(source)
    dest = _destination(destination, destination_options)
    manifest, holders = resolve(store.committed_tiers, step=step, name=name)
    present = dest.find_manifest(manifest.name)
    if present is not None:
        if present.attempt != manifest.attempt:
            raise CheckpointExists(
                f"the destination holds another attempt ({present.attempt}) of this checkpoint "
                f"than the source ({manifest.attempt}); it is never overwritten",
                checkpoint=manifest.name,
                tier=dest.label,
            )
        log.info("%s is already committed in %s", manifest.name, dest.label)
        return CopyReport(manifest, (), dest.label, 0, 0, already_there=True)
    sent = _count_writes(dest)
    held = [lease for tier in holders if (lease := leases.take(tier, manifest.name, purpose="copy"))]
    bar = _Monotonic(progress)
    tried: list[str] = []
    try:
        for index, tier in enumerate(holders):
            tried.append(tier.label)
            copier = _Copier(tier, dest, config)
            status = copier.migrate_checkpoint(manifest, progress=bar)
            if status.state is MigrationState.COMMITTED:
                log.info(
                    "copied %s from %s to %s (%d bytes sent)",
                    manifest.name,
                    tier.label,
                    dest.label,
                    sent.bytes,
                )
                return CopyReport(manifest, tuple(tried), dest.label, sent.bytes, sent.files)
            error = copier.error(manifest)
            if not _damaged_in(error, tier) or index == len(holders) - 1:
                raise error
            log.warning(
                "copy of %s: %s; going on from %s (files already verified at the destination "
                "are not sent again)",
                manifest.name,
                error,
                holders[index + 1].label,
            )
    finally:
        for lease in held:
            lease.release()
    raise AssertionError("unreachable: resolve names at least one tier")


def _destination(destination: Store | TierURL, options: dict[str, Any] | None) -> Tier:
    if isinstance(destination, Store):
        if options:
            raise ConfigError(
                "pass destination_options with a URL, not with a Store: the store has its options"
            )
        nearest = destination.tiers[0]
        return Tier(DESTINATION, nearest.url, nearest.options)
    return Tier(DESTINATION, destination, options)


def _damaged_in(error: TierstoreError, tier: Tier) -> bool:
    """Whether ``error`` is a source file missing or damaged in ``tier`` (another tier may
    hold it intact), not a failure of the destination."""
    return isinstance(error, (ChecksumMismatch, ObjectNotFound)) and error.tier == tier.label


class _Copier(Migrator):
    """The migrator with the destination as its cold tier, committing without marking the
    source migrated, and keeping the failure a job ended in (to raise it)."""

    def __init__(self, source: Tier, destination: Tier, config: MigrationOptions) -> None:
        super().__init__(source, destination, config)
        self._failure: JobFailed | None = None

    def _record_failure(self, job: Job, failure: JobFailed) -> None:
        self._failure = failure
        super()._record_failure(job, failure)

    def error(self, manifest: Manifest) -> TierstoreError:
        """The failure as the error to raise: the one the copy met, when it is tierstore's."""
        failure = self._failure
        cause = failure.error if failure is not None else "the copy did not commit"
        if isinstance(cause, TierstoreError):
            return cause
        return TierstoreError(
            f"copy failed: {cause}",
            checkpoint=manifest.name,
            file=failure.file if failure is not None else None,
            tier=self.cold.label,
        )

    def _commit(self, manifest: Manifest, job: Job | None = None) -> None:
        # Migrator's cold commit (migration.cold_commit), less the migrated mark in the source
        # (module docstring) and the store identity (a destination is not any store's cold tier).
        by_rank = files_by_rank(manifest)
        listing = self._await_marks(manifest, by_rank, job)
        if listing is None:
            return  # another copy committed this very attempt meanwhile
        faults.point("copy.before_publish")
        self._check_in_place(manifest, by_rank, listing)  # every file verified in place: invariant 10
        self._publish(manifest)
        faults.point("copy.after_publish")
        try:
            marks.clear_upload_marks(self.cold, manifest.name, manifest.attempt, listing.keys)
        except TierstoreError as err:
            log.info("left upload marks of %s for GC: %s", manifest.name, err)

    def _publish(self, manifest: Manifest) -> None:
        # The cold commit's publish, with a copy's words when another attempt won the name
        # meanwhile (a concurrent save or copy there): refused, never overwritten (invariant 3).
        try:
            super()._publish(manifest)
        except JobFailed as failure:
            if isinstance(failure.error, CheckpointExists):
                raise JobFailed(
                    None,
                    None,
                    CheckpointExists(
                        "another attempt of this checkpoint was committed at the destination "
                        "meanwhile; it is never overwritten, so nothing of this copy is published",
                        checkpoint=manifest.name,
                        tier=self.cold.label,
                    ),
                ) from failure
            raise


class _Monotonic:
    """A progress callback that never goes back: a copy going on from the next tier counts
    again the files already at the destination, which the display has shown already."""

    def __init__(self, progress: ProgressCallback | None) -> None:
        self.progress = progress
        self._shown: dict[str, int] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.progress is None or done <= self._shown.get(label, -1):
            return
        self._shown[label] = done
        self.progress(label, done, total)


class _Sent:
    """Bytes and files a tier's writers committed (closed), counted across threads."""

    def __init__(self) -> None:
        self.bytes = self.files = 0
        self.lock = threading.Lock()


def _count_writes(tier: Tier) -> _Sent:
    """Count what is written to ``tier`` from now on (its backend wrapped, nothing else changed)."""
    sent = _Sent()
    tier._backend = cast(Backend, _CountingBackend(tier.backend, sent))
    return sent


class _CountingBackend:
    def __init__(self, backend: Backend, sent: _Sent) -> None:
        self._inner, self._sent = backend, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return _CountingWriter(self._inner.open_write(key, *args, **kwargs), self._sent)


class _CountingWriter:
    def __init__(self, writer: Any, sent: _Sent) -> None:
        self._inner, self._sent = writer, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        self._inner.close()  # raises if the object was not stored as written: not counted
        with self._sent.lock:
            self._sent.bytes += self._inner.size
            self._sent.files += 1

    def __enter__(self) -> _CountingWriter:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._inner.abort()
