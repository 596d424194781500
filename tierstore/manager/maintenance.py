"""Keeping a store pruned and its pending migrations moving, in the background, and the
free-space relief before a save (docs/design.md invariants 15, 19, 22)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future

from tierstore import _dist
from tierstore.errors import TierstoreError
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.lifecycle.prune import PruneReport, check_cold_copies, prune, prune_tier
from tierstore.lifecycle.retention import Retention, keep_none
from tierstore.lifecycle.rounds import BackgroundRounds
from tierstore.manager.group import Group
from tierstore.manager.runs import RunGuard
from tierstore.migration.delivery import resume_pending
from tierstore.migration.migrator import MigrationOptions, Migrator, files_by_rank
from tierstore.migration.workers import migrator_for, migrators_of
from tierstore.tiers import marks
from tierstore.tiers.tier import Store

__all__ = ["Maintenance"]

log = logging.getLogger(__name__)

RESUME_LOOK = 10.0  # seconds a node-local start waits for the cold tier to find what is pending


class Maintenance:
    """A manager's background maintenance of ``store`` (module docstring): pruning by
    ``retention`` (over ``guard``'s run alone), the pending migrations moved on, the hot
    tier's free-space watermark kept before each save. Its errors never reach the loop:
    :attr:`errors` names them."""

    def __init__(
        self,
        store: Store,
        retention: Retention,
        guard: RunGuard,
        group: Group,
        migration: MigrationOptions | None,
    ) -> None:
        assert store.hot is not None  # store_to_save refused a store without one
        self.store, self.hot, self.retention, self.guard = store, store.hot, retention, guard
        self.node_local, self.migration, self._group = store.node_local, migration, group
        self.closing = False  # close() began: rounds prune, but queue no more migrations
        self._inherited: set[str] | None = None  # pending from earlier jobs, once a round read cold
        self._lock = threading.Lock()
        self._errors: list[str] = []
        self._rounds = BackgroundRounds(
            lambda full: self._maintain(prune=full), name="tierstore-prune", on_error=self._round_failed
        )

    @property
    def resumes_pending(self) -> bool:
        """Whether this process finishes pending migrations it finds: the coordinator of a
        store whose hot tier holds every rank's files (node-local ones hold their node's)."""
        return self._group.rank == 0 and not self.node_local and self.store.cold is not None

    @property
    def prunes(self) -> bool:
        """Whether this process prunes after its saves: the coordinator, or every rank of
        node-local hot tiers (each its own node's)."""
        return self._group.rank == 0 or self.node_local

    def migrators(self) -> list[Migrator]:
        """This process's migrators to the cold tier (none without one)."""
        cold = self.store.cold
        return [] if cold is None else migrators_of(self.hot, cold)

    def start(self) -> None:
        """At the manager's start: the pending migrations a killed run left, finished in the
        background (node-local: each rank queues its own files now)."""
        if self.resumes_pending:
            self.request(prune=False)
        elif self.node_local and self.store.cold is not None:
            self._resume_node_local()

    def request(self, *, prune: bool = True) -> Future[None]:
        """A maintenance round on the manager's background thread (one at a time, commits
        landing meanwhile fold into one more: :mod:`tierstore.lifecycle.rounds`): prune
        (unless ``prune`` is false) and resume the pending migrations that round found."""
        return self._rounds.request(prune)

    def running(self) -> Future[None] | None:
        """The round running now, if any."""
        return self._rounds.running()

    @property
    def errors(self) -> tuple[str, ...]:
        """The errors of the last prune that had any, and of every failed round."""
        with self._lock:
            return tuple(self._errors)

    def _round_failed(self, err: Exception) -> None:
        log.error("pruning failed: %s", err)
        with self._lock:
            self._errors.append(str(err))

    def _maintain(self, *, prune: bool) -> None:
        """One round: prune, then queue the migration of every hot checkpoint the round
        found never committed in cold and no migrator of this process works on."""
        began = time.monotonic()  # what the round finds pending is as of (at least) now
        read = True  # whether the round read the cold tier (else what is pending is unknown)
        if prune:
            reports = self.prune()
            pending = [name for r in reports for name in r.pending]
            read = all(r.cold_read for r in reports)
        elif self.resumes_pending:
            assert self.store.cold is not None
            check = check_cold_copies(self.hot, self.store.cold)
            pending, read = sorted(check.pending), check.cold_read
        else:
            pending = []
        if not self.resumes_pending or self.closing or _interpreter_exiting():
            return
        assert self.store.cold is not None
        migrator = migrator_for(self.hot, self.store.cold, self.migration)
        if self._inherited is None and read:
            # What earlier jobs left pending, as the first round that read the cold tier saw
            # it: this manager finishes those, and its own. A checkpoint pending later that
            # it did not save is another live job's (a second manager on this directory),
            # which that job delivers (invariant 25).
            self._inherited = {name for name in pending if not _saved_here(name, migrator)}
        inherited = self._inherited or set()
        resume = [name for name in pending if name in inherited or _saved_here(name, migrator)]
        if resume:
            resume_pending(migrator, self.hot, resume, since=began)

    def _resume_node_local(self) -> None:
        """Node-local tiers: every rank queues its own files of the checkpoints its job left
        pending, and the coordinator their commits, as the writer does after a save. Only
        the coordinator knows them (its node holds the hot manifests): one broadcast at start,
        after a look at the cold tier bounded by ``RESUME_LOOK`` seconds (a cold tier that is
        down delays the start by at most that, and nothing is resumed then)."""
        group = self._group.group
        cold, rank = self.store.cold, _dist.group_rank_world(group)[0]
        assert cold is not None
        found: list[Manifest] = []
        if rank == 0:
            looker = threading.Thread(
                target=lambda: found.extend(self._pending_manifests()),
                name="tierstore-resume-look",
                daemon=True,
            )
            looker.start()
            looker.join(RESUME_LOOK)
            if looker.is_alive():
                log.warning(
                    "the cold tier %s did not answer within %.0fs: pending migrations "
                    "are not resumed at this start",
                    cold.label,
                    RESUME_LOOK,
                )
                found = []
        jobs = [(m.name, m.attempt, m.step, files_by_rank(m)) for m in found]
        if self._group.distributed:
            jobs = _dist.broadcast(jobs, group)
        migrator = migrator_for(self.hot, cold, self.migration)
        for manifest in found:  # the coordinator: its own files, then the commit
            migrator.submit_commit(manifest, rank)
        if rank != 0:
            for name, attempt, step, by_rank in jobs:
                if by_rank.get(rank):
                    migrator.submit_rank(name, attempt, step, rank, by_rank[rank])
        if jobs:
            log.info("resuming the migration of %s to %s", ", ".join(j[0] for j in jobs), cold.label)

    def _pending_manifests(self) -> list[Manifest]:
        cold = self.store.cold
        assert cold is not None
        try:
            pending = check_cold_copies(self.hot, cold).pending
        except TierstoreError as err:
            log.warning("could not look for pending migrations: %s", err)
            return []
        return [m for m in self.hot.manifests() if m.name in pending]

    def prune(self) -> list[PruneReport]:
        """Apply the retention policies now (the coordinator does this after each commit)."""
        reports = prune(
            Store.of(self.store, node_local=self.node_local),
            hot_policy=self.guard.own(self.retention.hot),
            cold_policy=self.guard.own(self.retention.cold),
            prune_cold=not self.node_local or self._group.rank == 0,
        )
        errors = [e for r in reports for e in r.errors]
        if errors:
            with self._lock:
                self._errors[:] = errors
        return reports

    def relieve_disk_pressure(self) -> None:
        """Below the hot tier's free-space watermark, prune it beyond policy, from hot-tier
        knowledge alone: this runs before a save, where no cold request may be made. A hot
        copy goes only if the hot tier's migrated mark names the cold tier's identity (known
        once any background prune reached the cold tier), checked once in the listing the
        decision is made from and again right before its un-publish; the rest is kept."""
        if self.retention.hot_min_free is None or not self.prunes:
            return
        hot, cold = self.hot, self.store.cold
        free = hot.backend.free_bytes()
        if free is None:
            return
        manifests = None  # listed only where needed: this runs before every save
        threshold = self.retention.hot_min_free
        if threshold == "auto":
            manifests = hot.manifests()
            newest = max(manifests, key=checkpoint_order, default=None)
            threshold = int(newest.total_size * 1.1) if newest is not None else 0
        if free >= int(threshold):
            return
        manifests = hot.manifests() if manifests is None else manifests
        protect: set[str] = set()
        still_safe = None
        if cold is not None:
            cold_id = cold.store_id  # as this process last read it: no request before a save
            protect = {m.name for m in manifests if not marks.was_migrated(hot, m, cold_id)}

            def still_safe(manifest: Manifest) -> str | None:
                if marks.was_migrated(hot, manifest, cold_id):
                    return None
                return "no migrated mark names the cold tier"

        report = prune_tier(
            hot, self.guard.own(keep_none()), protect=protect, manifests=manifests, still_safe=still_safe
        )
        log.warning(
            "hot tier %s below its free-space watermark (%d bytes free, want %d): "
            "pruned %s beyond policy; kept the newest and those not known to be in "
            "cold (%s)",
            hot.label,
            free,
            threshold,
            list(report.deleted),
            sorted(protect),
        )


def _saved_here(name: str, migrator: Migrator) -> bool:
    """Whether ``migrator`` has had a job of checkpoint ``name`` (this process saved it)."""
    return any(s.name == name for s in migrator.status())


def _interpreter_exiting() -> bool:
    return sys.is_finalizing() or getattr(threading, "_SHUTTING_DOWN", False)
