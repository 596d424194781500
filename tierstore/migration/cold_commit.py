"""The cold commit: the coordinator's last step of a migration (docs/design.md invariant 10).

It waits until one listing of the upload marks shows every rank marked for exactly its files
of the manifest, proves every file in place with the bytes that were verified (by the listed
CRC32C, by the object versions the marks name, or by verifying it again), publishes the cold
manifest exclusively, marks the hot attempt migrated and clears the marks. A mixin of
:class:`tierstore.migration.migrator.Migrator`, which supplies the tiers, config and sleep.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from tierstore.errors import CheckpointExists, ChecksumMismatch, IntegrityError, TierstoreError
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.jobs import Job, JobFailed, JobStopped, MigrationOptions, files_by_rank, in_parallel
from tierstore.migration.transfer import verified_copy
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers import marks
from tierstore.tiers.tier import Tier

__all__ = ["ColdCommit"]

log = logging.getLogger(__name__)


class ColdCommit:
    """The cold commit of :class:`~tierstore.migration.migrator.Migrator` (module docstring)."""

    hot: Tier
    cold: Tier
    config: MigrationOptions
    _sleep: Callable[[float], None]

    def _commit(self, manifest: Manifest, job: Job | None = None) -> None:
        by_rank = files_by_rank(manifest)
        listing = self._await_marks(manifest, by_rank, job)
        if listing is None:  # another migrator committed it meanwhile
            cold_id = marks.store_id(self.cold, create=True)
            assert cold_id is not None
            marks.mark_migrated(self.hot, manifest, cold_id)
            return
        cold_id = marks.store_id(self.cold, create=True)
        assert cold_id is not None  # created if it was missing
        faults.point("migrator.before_cold_publish")
        # The marks say every rank uploaded; the manifest may only vouch for bytes that are
        # verified and in place now (another actor may have removed or replaced an object
        # since): docs/design.md invariant 10.
        try:
            self._check_in_place(manifest, by_rank, listing)
        except JobFailed:
            if self._pruned_since_delivered(manifest, cold_id):
                return  # another migrator delivered it and the cold policy pruned it since
            raise
        faults.point("migrator.after_cold_check")
        if self._pruned_since_delivered(manifest, cold_id):
            return  # committed once and pruned by the cold policy since: not to be put back
        self._publish(manifest)
        faults.point("migrator.after_cold_publish")
        marks.mark_migrated(self.hot, manifest, cold_id)
        # The marks did their job; a crash before this leaves them to GC.
        try:
            marks.clear_upload_marks(self.cold, manifest.name, manifest.attempt, listing.keys)
        except TierstoreError as err:
            log.info("left upload marks of %s for GC: %s", manifest.name, err)

    def _check_in_place(
        self, manifest: Manifest, by_rank: dict[int, tuple[FileEntry, ...]], listing: marks.MarkListing
    ) -> None:
        """Raise unless every file of ``manifest`` is in the cold tier with its verified bytes.

        One listing per data prefix shows presence and size, and CRC32C where the store
        lists it (GCS). A rank's files are proved by that CRC32C, or by being listed at the
        very versions its mark says it verified; a rank whose files are not (one replaced
        since the upload, by anyone, or a store without versions) has each file verified
        again here, by the store's CRC32C or by reading it back.
        """
        name, attempt = manifest.name, manifest.attempt
        absent, listed = marks.check_in_place(
            self.cold, name, attempt, (f for files in by_rank.values() for f in files)
        )
        if absent:
            raise self._not_as_uploaded(manifest, absent, "missing, or its size differs")
        unproved = [
            f
            for rank, files in by_rank.items()
            if not self._proved(listing, rank, files, listed)
            for f in files
        ]
        if not unproved:
            return
        log.info(
            "verifying %d file(s) of %s again before the cold commit: not listed as the "
            "objects their ranks verified",
            len(unproved),
            name,
        )
        bad: list[FileEntry] = []
        checks = [functools.partial(self._recheck, manifest, entry, bad) for entry in unproved]
        for error in in_parallel(checks, self.config.concurrency):
            if error is not None:
                raise JobFailed(None, None, error)
        if bad:
            raise self._not_as_uploaded(
                manifest,
                sorted(bad, key=lambda f: (f.rank, f.path)),
                "its bytes differ from the ones uploaded",
            )

    def _proved(
        self,
        listing: marks.MarkListing,
        rank: int,
        files: tuple[FileEntry, ...],
        listed: dict[str, ObjectInfo],
    ) -> bool:
        if all(listed[f.path].crc32c is not None for f in files):
            return True  # the store's own CRC32C, compared by check_in_place
        now = {f.path: listed[f.path].version for f in files}
        return listing.vouches(rank, marks.files_digest(files), marks.versions_digest(files, now))

    def _recheck(self, manifest: Manifest, entry: FileEntry, bad: list[FileEntry]) -> None:
        if (
            verified_copy(
                self.cold, manifest.name, manifest.attempt, entry, chunk_size=self.config.chunk_size
            )
            is None
        ):
            bad.append(entry)

    def _not_as_uploaded(self, manifest: Manifest, files: Sequence[FileEntry], why: str) -> JobFailed:
        entry = files[0]
        return JobFailed(
            entry.rank,
            entry.path,
            ChecksumMismatch(
                f"not in the cold tier as uploaded ({why}; {len(files)} file(s) in all) at the "
                "cold commit; `tierstore migrate` uploads it again",
                checkpoint=manifest.name,
                file=entry.path,
                tier=self.cold.label,
            ),
        )

    def _publish(self, manifest: Manifest) -> None:
        def publish() -> None:
            try:
                self.cold.publish_manifest(manifest)
            except CheckpointExists:
                existing = self.cold.find_manifest(manifest.name)
                if existing is None or existing.attempt != manifest.attempt:
                    other = existing.attempt if existing is not None else "unknown"
                    raise CheckpointExists(
                        f"the cold tier holds another committed attempt ({other}) of this "
                        "checkpoint; it is never overwritten, so this attempt stays hot only",
                        checkpoint=manifest.name,
                        tier=self.cold.label,
                    ) from None
                # ours already: an earlier run (or an ambiguous publish) committed it

        try:
            self.config.retry.call(publish, what=f"cold commit of {manifest.name}", sleep=self._sleep)
        except Exception as err:
            raise JobFailed(None, None, err) from err

    def _await_marks(
        self, manifest: Manifest, by_rank: dict[int, tuple[FileEntry, ...]], job: Job | None = None
    ) -> marks.MarkListing | None:
        """Wait until one listing shows every rank marked for its files of ``manifest`` (that
        listing), or until another migrator has committed this very attempt (``None``: it also
        removed the marks, so waiting on would only run into the timeout)."""
        expected = {rank: marks.files_digest(files) for rank, files in by_rank.items()}
        # Remembered across rounds (each round only lists); the job's own rank marked its
        # files just before (or found them marked), so its mark is seen from the start.
        seen: set[int] = {job.rank} if job is not None and job.rank in expected else set()
        last: list[marks.MarkListing] = []
        faults.point("migrator.before_marks_listing")

        def missing() -> list[int] | None:
            """Ranks still to mark; ``None`` once another migrator committed the attempt."""
            if job is not None and job.stopped:  # stop() ends the wait too, not only uploads
                raise JobFailed(None, None, JobStopped(f"migration of {manifest.name} stopped"))
            for _ in range(2):  # a mark seen before and not listed now: listed again
                listing = marks.list_marks(self.cold, manifest.name, manifest.attempt)
                last[:] = [listing]
                marked = {rank for rank, digest in expected.items() if listing.marked(rank, digest)}
                gone = seen - marked
                if not gone:
                    break
            if gone:  # proven gone: another migrator's commit cleared them, or a prune took them
                if self._committed_by_another(manifest):
                    log.info("%s was committed in %s by another migrator", manifest.name, self.cold.label)
                    return None
                self._marks_deleted(manifest, sorted(gone))  # raises unless delivered and pruned
                return None
            seen.update(marked)
            left = [rank for rank in expected if rank not in seen]
            if not left:
                return left
            if self._committed_by_another(manifest):
                log.info("%s was committed in %s by another migrator", manifest.name, self.cold.label)
                return None
            for rank in left:
                if rank in listing.failed:  # read only the failure marks the listing shows
                    failure = marks.read_failure(self.cold, manifest.name, manifest.attempt, rank)
                    if failure is not None:
                        raise JobFailed(rank, failure.get("file"), failure.get("error", "failed"))
            return left

        left = self.config.mark_polling.poll(missing, until=lambda left: not left, sleep=self._sleep)
        if left:
            raise JobFailed(
                left[0], None, f"no upload mark from ranks {left} after {self.config.commit_timeout:.0f}s"
            )
        return None if left is None else last[0]

    def _marks_deleted(self, manifest: Manifest, ranks: list[int]) -> None:
        """The upload marks of ``ranks`` were deleted while the commit waited, and no
        commit of this attempt is in the cold tier: a prune of the cold tier took the
        attempt (it was delivered once, and its policy removed it: returns, nothing more
        to do), or something else deleted them (the job fails at once; the checkpoint
        stays pending, and the next try uploads what is missing). Never a wait that only
        ``commit_timeout`` ends (invariant 25)."""
        if self._pruned_since_delivered(manifest):
            return
        raise JobFailed(
            ranks[0],
            None,
            f"the upload marks of ranks {ranks} were deleted from the cold tier while the commit "
            "waited for the others (a prune or gc of the cold tier); the checkpoint stays pending",
        )

    def _pruned_since_delivered(self, manifest: Manifest, cold_id: str | None = None) -> bool:
        """Whether the hot tier records ``manifest``'s attempt as committed in this cold
        tier, which holds no commit of it now: delivered, then pruned by the cold policy.
        With the cold tier's identity known (``cold_id``), no cold request unless the hot
        tier holds such a mark."""
        try:
            cold_id = marks.store_id(self.cold) if cold_id is None else cold_id
            if cold_id is None or not marks.was_migrated(self.hot, manifest, cold_id):
                return False
            there = self.cold.find_manifest(manifest.name)
        except TierstoreError:
            return False
        if there is not None and there.attempt == manifest.attempt:
            return False
        log.info(
            "%s (attempt %s) was delivered to %s and pruned there since: not committed again",
            manifest.name,
            manifest.attempt,
            self.cold.label,
        )
        return True

    def _committed_by_another(self, manifest: Manifest) -> bool:
        try:
            return self.cold.find_manifest(manifest.name) == manifest
        except IntegrityError:
            return False  # an invalid cold manifest commits nothing; the publish will say so
