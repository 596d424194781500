"""Loading: the newest checkpoint that loads verified, falling back past damaged ones (which
are quarantined: docs/design.md invariant 21), under the world size it was saved by or another;
with a run name, among that run's checkpoints only (:mod:`tierstore.manager.runs`)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from tierstore import _dist
from tierstore.dcp.failures import causes
from tierstore.dcp.failures import describe as describe_failure
from tierstore.dcp.reader import TieredReader, is_damage
from tierstore.errors import ConfigError, TierstoreError
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.lifecycle.quarantine import quarantine_proven
from tierstore.manager.copies import PeerCopies
from tierstore.manager.group import Group
from tierstore.manager.runs import RunGuard, ours
from tierstore.options import ReaderOptions
from tierstore.resume.state import ResumePlanner, is_per_rank_key
from tierstore.tiers.catalog import CheckpointInfo, list_checkpoints
from tierstore.tiers.tier import Store

__all__ = ["Loader"]

log = logging.getLogger(__name__)

COLD_LOOK = 5.0  # seconds a load with copies on other nodes waits for the cold tier's listing


class Loader:
    """A manager's loads (module docstring): ``store``'s checkpoints, as listed in ``catalog``
    (its cold tier alone for node-local hot tiers), those of ``guard``'s run; the damaged ones
    it falls back past are quarantined and named in :attr:`quarantined`."""

    def __init__(
        self, store: Store, catalog: Store, guard: RunGuard, group: Group, copies: PeerCopies | None = None
    ) -> None:
        self.store, self.catalog, self.guard, self._group = store, catalog, guard, group
        self._copies = copies if copies is not None and copies.on else None
        self._lock = threading.Lock()
        self._quarantined: list[str] = []
        self.sources: dict[str, str] = {}  # where this rank's last load read each file from

    @property
    def quarantined(self) -> tuple[str, ...]:
        """The checkpoints this manager's resumes quarantined, each once."""
        with self._lock:
            return tuple(dict.fromkeys(self._quarantined))

    def steps(self) -> list[int]:
        """The steps of the store's checkpoints, oldest first; with a run name, of its own only."""
        found = self._listed()
        return [c.step for c in found if c.step is not None and ours(c, self.guard.run)]

    def _listed(self) -> list[CheckpointInfo]:
        """The catalog's checkpoints; with copies on other nodes, this node's protected ones
        too, the cold tier's looked at for at most ``COLD_LOOK`` seconds (it may be down:
        the copies are a catalog of their own)."""
        if self._copies is None:
            return list_checkpoints(self.catalog)
        merged: dict[tuple[str, str], tuple[Manifest, list[str]]] = {}
        for manifest in self._copies.protected():
            merged[(manifest.name, manifest.attempt)] = (manifest, ["peer"])
        cold: list[CheckpointInfo] = []
        failure: list[BaseException] = []

        def look() -> None:
            try:
                cold.extend(list_checkpoints(self.catalog))
            except Exception as err:
                failure.append(err)

        looker = threading.Thread(target=look, name="tierstore-cold-look", daemon=True)
        looker.start()
        looker.join(COLD_LOOK)
        if looker.is_alive() or failure:
            log.warning(
                "listing checkpoints from this node's copies only: the cold tier %s %s",
                self.catalog.label,
                f"failed: {failure[0]}" if failure else f"did not answer within {COLD_LOOK:.0f}s",
            )
            cold = []
        infos = [CheckpointInfo.of(m, roles) for m, roles in merged.values()]
        known = {(i.name, i.attempt) for i in infos}
        infos += [c for c in cold if (c.name, c.attempt) not in known]
        return sorted(infos, key=checkpoint_order)

    def load(
        self, state: dict[str, Any], *, name: str | None = None, step: int | None = None, planner: Any = None
    ) -> int | None:
        """Load into ``state`` the checkpoint ``name``, else the newest (of ``step``, if
        given) that loads verified, falling back past damaged ones; its step, or ``None`` if
        there is none (:meth:`CheckpointManager.load_latest` and
        :meth:`CheckpointManager.load` say the rules). On every rank alike."""
        group, distributed = self._group.group, self._group.distributed
        coordinator = not distributed or dist.get_rank(group) == 0
        candidates = [name] if name is not None else []  # newest first; known to the coordinator
        attempts: dict[str, str] = {}  # the attempt of each candidate as the coordinator listed it
        if name is None:
            candidates = self._candidates(step, coordinator, attempts)
        damaged: list[CheckpointException] = []
        # The damaged ones, quarantined once an older one loads.
        set_aside: list[tuple[Manifest, CheckpointException]] = []
        while True:
            chosen = candidates[len(damaged)] if len(damaged) < len(candidates) else None
            if distributed:  # every rank loads what the coordinator picked
                chosen = _dist.broadcast(chosen, group)
            if chosen is None:
                break
            reader = TieredReader(
                self.store,
                name=chosen,
                options=ReaderOptions(resolve_once=True),
                process_group=group,
            )
            if self._copies is not None:
                reader.peer_fetch = self._copies.fetch
                reader.attempt = attempts.get(chosen)
            world = dist.get_world_size(group) if distributed else 1
            used = planner if planner is not None else _default_planner(reader, world)
            try:
                dcp_load(state, storage_reader=reader, process_group=group, planner=used)
            except CheckpointException as err:  # the same on every rank: DCP gathers failures
                _raise_if_resized(err, reader, world, chosen)
                self.guard.raise_if_mismatched(err, reader, used, chosen)
                if name is not None or not is_damage(err):
                    raise
                damaged.append(err)
                if reader.manifest is not None:
                    set_aside.append((reader.manifest, err))
                log.warning(
                    "checkpoint %s is damaged in every tier holding it, loading the next "
                    "older one instead: %s",
                    chosen,
                    describe_failure(err),
                )
                continue
            finally:
                # dcp.load returned or raised on this rank only once no rank reads (its last
                # step is a collective), so the job's lease may go, even if planning failed
                # before the reads that would have released it.
                reader.release()
            assert reader.manifest is not None
            self.sources = dict(reader.sources)
            if self._copies is not None:  # the load report: where this rank's bytes came from
                counts = {
                    where: list(self.sources.values()).count(where) for where in set(self.sources.values())
                }
                log.info(
                    "loaded %s on rank %d: %s",
                    reader.manifest.name,
                    _dist.rank_world()[0],
                    ", ".join(f"{n} file(s) from {where}" for where, n in sorted(counts.items())),
                )
            if coordinator:
                self._quarantine(set_aside, loaded=reader.manifest.name)
                self.guard.loaded(reader.manifest)
            return reader.manifest.step
        if damaged:  # nothing loads: kept as they are, for a person to look at (loudly)
            raise damaged[0]
        return None

    def _candidates(self, step: int | None, coordinator: bool, attempts: dict[str, str]) -> list[str]:
        """The checkpoints to try, newest first, known to the coordinator (others get an
        empty list): with a run name, its own (:meth:`RunGuard.resumable`). Its listing's error (or
        ``RunOptions(strict=True)``'s) reaches every rank, so none waits for ever on a coordinator
        that gave up (node-local with the cold tier down)."""
        found: Any = None
        if coordinator:
            try:
                listed = self._listed()
                resumable = list(reversed(self.guard.resumable(listed, step, self.catalog.label)))
                found = list(dict.fromkeys(c.name for c in resumable))  # a name once: its newest attempt
                for c in reversed(resumable):  # oldest first: the newest attempt of a name wins
                    attempts[c.name] = c.attempt
            except Exception as err:  # raised below on every rank alike
                found = err
        if self._group.distributed:
            found = _dist.broadcast(found, self._group.group)
        if isinstance(found, BaseException):
            raise found
        return list(found) if coordinator else []

    def _quarantine(self, damaged: list[tuple[Manifest, CheckpointException]], *, loaded: str) -> None:
        """Set aside each checkpoint a resume fell back past (invariant 21): its step is
        trained again and saved as a new attempt, and retention never counts it again. Only
        in a tier where its damage is proven now (issue 34: one 404 is no proof;
        :func:`~tierstore.lifecycle.quarantine.quarantine_proven`): a good copy stays."""
        for manifest, err in damaged:
            reason = (
                f"a resume found it damaged in every tier holding it and loaded {loaded} "
                f"instead: {describe_failure(err)}"
            )
            done = False
            for tier in self.store.tiers:
                try:
                    here = tier.find_manifest(manifest.name)  # this tier's own copy is the record
                    if here is not None and here.attempt == manifest.attempt:
                        done = quarantine_proven(tier, here, reason, causes(err)) or done
                except TierstoreError as failure:  # kept published: the next resume retries
                    log.error("could not quarantine %s in %s: %s", manifest.name, tier.label, failure)
            if done:
                with self._lock:
                    self._quarantined.append(manifest.name)


def _saved_world(reader: TieredReader, world: int) -> int | None:
    """The world size that saved the checkpoint ``reader`` opened, when it is not ``world``
    (the manifest is known once DCP asked the reader for the metadata, before planning)."""
    saved = reader.manifest.world_size if reader.manifest is not None else None
    return saved if saved != world else None


@dataclass(frozen=True)
class _PerRankIfResized:
    """``ResumePlanner``'s ``optional``: per-rank keys may be absent only under a world size
    other than the checkpoint's; at the same world size every key stays required."""

    reader: TieredReader
    world: int

    def __call__(self, key: str) -> bool:
        return _saved_world(self.reader, self.world) is not None and is_per_rank_key(key)


def _default_planner(reader: TieredReader, world: int) -> ResumePlanner:
    return ResumePlanner(optional=_PerRankIfResized(reader, world))


def _raise_if_resized(err: CheckpointException, reader: TieredReader, world: int, name: str) -> None:
    """Under a new world size, DCP's "Missing key" error becomes one that says what to do."""
    saved = _saved_world(reader, world)
    missing = next((str(c) for c in causes(err) if "Missing key" in str(c)), None)
    if saved is None or missing is None:
        return
    raise ConfigError(
        f"checkpoint saved by {saved} ranks cannot be loaded as it is by {world} ranks: {missing} "
        "Per-rank state must be optional under a new world size: load with planner="
        "tierstore.ResumePlanner(optional=lambda key: ...) accepting that key, or save such "
        "state under keys every world size has",
        checkpoint=name,
    ) from err
