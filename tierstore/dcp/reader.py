"""``TieredReader``: a DCP ``StorageReader`` that trusts only what a manifest vouches for.

It picks a committed checkpoint by manifest (the newest in any tier unless told otherwise),
reads DCP's ``.metadata`` only after checking its size and CRC32C against the manifest,
and verifies every data file's size and CRC32C as it streams it. A file that fails in one
tier is read again from the next tier holding the checkpoint, with a warning; when no tier
has a good copy the load stops with an error naming checkpoint, file, tier, expected and
actual values (docs/design.md invariant 5). That error is damage (what a resume steps back
past and quarantines) only once proven: every tier read a second time, and a file missing
only where a second request and the tier's listing agree; else the load raises what the
tier did instead (issue 34: one transient 404 must not cost the newest checkpoint).

A dcp-encoded file (``_StorageInfo`` in the metadata) is verified per file as its bytes
stream by, so a corrupt file is detected after some of its items may already have been
copied into the target state. A raw-encoded file (``RawItem``: :mod:`tierstore.dcp.raw_read`)
is read only where the load plan needs it, in ranged requests, and verified per 4 MiB block
(CRC32C in the ``RawItem``) as each item arrives; bytes outside every wanted block are never
read, so damage there is found by ``tierstore verify``, not by a load. Either way the load
then re-reads that file (or that thread's part of it) from another tier or raises: it never
completes on bad bytes it read (docs/design.md invariant 5), and damage is reported as the
file's size or CRC32C mismatch, the message scrub and transfer give for the same damage (a
raw copy found damaged is read whole once, for that message).

This module is the ``StorageReader``: DCP's protocol methods, and picking and leasing a
checkpoint, which share the state of one load. What does not lives beside it: the reads of
the chosen checkpoint's files (:mod:`tierstore.dcp.file_reads`), reading one file from the
nearest tier whose copy verifies, and what counts as damage
(:mod:`tierstore.dcp.fallback`), reading dcp-encoded items (:mod:`tierstore.dcp.dcp_files`),
the listing checks of a candidate (:mod:`tierstore.dcp.listing`), ranged raw reads
(:mod:`tierstore.dcp.raw_read`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierstore import _dist
from tierstore._redact import redact_url
from tierstore.dcp import dcp_args, raw_read
from tierstore.dcp.fallback import is_damage
from tierstore.dcp.file_reads import FileReads
from tierstore.dcp.listing import check_data_files
from tierstore.errors import (
    CheckpointNotFound,
    ConfigError,
    IntegrityError,
    InvalidManifest,
    TierstoreError,
)
from tierstore.format import layout
from tierstore.format.encoding import RawItem
from tierstore.format.manifest import Manifest
from tierstore.format.safe_pickle import load_metadata
from tierstore.options import ReaderOptions
from tierstore.storage import faults
from tierstore.tiers import leases
from tierstore.tiers.catalog import resolve
from tierstore.tiers.tier import Store, Tier, TierURL

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; the annotations are never evaluated

__all__ = ["TieredReader", "is_damage"]

log = logging.getLogger(__name__)


class TieredReader(StorageReader):
    """Load a DCP checkpoint from a tiered store.

    Args:
        hot, cold: the store's tiers as URLs or paths (either may be omitted, not both), or a
            :class:`~tierstore.Store` as ``hot``, where the tiers need options or the hot tier
            is node-local (``Store.of(hot, cold, node_local=True)``: the hot tier is per node,
            so each rank's hot root holds only its node's files and the cold manifest is the
            global commit; checkpoints are picked by cold manifest, and each file is read from
            the local hot tier when it is there and intact, else from cold). ``path=``
            (``FileSystemReader``'s name) is the same as ``hot``.
        step: load the newest checkpoint of this step.
        name: load the checkpoint of this name (a ``checkpoint_id`` given to ``dcp.load``
            does the same: a name, or a directory directly under a tier's root). With
            neither, the newest committed checkpoint in any tier that is not found damaged
            before loading: one whose manifest is invalid (a two-level manifest's part missing
            included), or whose ``.metadata`` or some data file is missing or damaged, in every
            tier holding it is skipped with a warning (bytes inside data files, and inside a
            part that is present at its size, are verified only when read;
            ``CheckpointManager.load_latest`` also falls back on those).
        options: how it reads (:class:`~tierstore.ReaderOptions`: read threads, leases, and
            ``resolve_once``). With ``resolve_once``, under a process group of more than one
            rank, the coordinator alone lists the catalog, picks and leases the checkpoint (one
            lease per job), and every other rank reads that checkpoint's manifest by name (one
            request per tier). :class:`~tierstore.manager.CheckpointManager` turns it on. Off
            by default for a reader handed to ``dcp.load`` directly, because it needs every
            rank of the group to call ``dcp.load`` (a collective inside the load): a load made
            by some ranks only (``dcp.load(no_dist=True)`` on one rank under an initialized
            group) would wait for ranks that never come. Turn it on for a job-wide resume of
            thousands of ranks.
        process_group: the process group given to ``dcp.load`` (default: the default group).
        _extension_registry: DCP's registry of stream transforms (``FileSystemReader``'s
            argument), for checkpoints saved with ``_extensions``; DCP's default knows
            ``ZStandard``.
        **filesystem_reader_args: ``FileSystemReader``'s ``path``. Any other keyword is a
            ``TypeError``, naming what to write instead for one tierstore took before 0.1.0
            (``node_local=``, ``cold_options=``, ``thread_count=``, ...).

    After a load, ``reader.manifest`` is the checkpoint that was read, ``reader.sources``
    maps each file this rank read to the tier (``"hot"``/``"cold"``) that served it, and
    ``reader.bytes_read`` maps each tier's label to the bytes this reader read from it in its
    last load: data (a raw file's gaps and whole edge blocks included, and what was read of a
    copy found damaged) and ``.metadata``. Manifests are read by the tier while the checkpoint
    is picked and are not counted.
    """

    def __init__(
        self,
        hot: TierURL | Store | None = None,
        cold: TierURL | None = None,
        *,
        step: int | None = None,
        name: str | None = None,
        options: ReaderOptions | None = None,
        process_group: Any = None,
        _extension_registry: ExtensionRegistry | None = None,
        **filesystem_reader_args: Unpack[dcp_args.FileSystemReaderArgs],
    ) -> None:
        super().__init__()
        dcp_args.reader_args(filesystem_reader_args)
        if options is not None and not isinstance(options, ReaderOptions):
            raise ConfigError(f"TieredReader(options=) takes a ReaderOptions, got {type(options).__name__}")
        self.options = options if options is not None else ReaderOptions()
        self.thread_count = self.options.thread_count
        self.store = Store.of(dcp_args.first_tier(hot, filesystem_reader_args, "TieredReader"), cold)
        self.tiers = self.store.tiers
        self._transforms = _StorageReaderTransforms(_extension_registry)
        self._bad_id: ConfigError | None = None
        self.node_local = self.store.node_local
        self.lease = self.options.lease
        self._leases: list[leases.Lease] = []
        self.resolve_once, self._group = self.options.resolve_once, process_group
        self._shared = False  # this load was resolved once for the whole job
        self.step = step
        self.name = layout.check_name(name) if name is not None else None
        self.manifest: Manifest | None = None
        self.sources: dict[str, str] = {}
        self.bytes_read: dict[str, int] = {}
        self._served: dict[str, int] = {}  # file -> the farthest holder a part of it came from
        self._lock = threading.Lock()
        self._holders: list[Tier] = []
        self._storage_data: dict[MetadataIndex, Any] = {}
        self._deferred: TierstoreError | None = None
        # Set by a manager with copies on other nodes: fetches, collectively, the files this
        # rank is about to read that its node lacks (tierstore.redundancy.protect.Peers.fetch).
        self.peer_fetch: Callable[[Manifest, list[str]], Any] | None = None
        # The attempt of ``name`` the caller picked (a manager's loader, from its listing): a
        # copy of another attempt is then never read, and no request asks the cold tier which.
        self.attempt: str | None = None

    # -- DCP protocol --------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # A lock does not pickle, nor does a process group.
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_group", "peer_fetch")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._group, self.peer_fetch = threading.Lock(), None, None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # DCP calls reset() outside the collectives that wrap errors in CheckpointException:
        # a bad checkpoint_id is raised from set_up_storage_reader, inside them.
        self._bad_id = None
        if checkpoint_id is not None:
            try:
                self.name = dcp_args.checkpoint_name(checkpoint_id, [t.url for t in self.tiers])
            except ConfigError as err:
                self._bad_id = err
        self.manifest = None
        self._storage_data = {}

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs on purpose: DCP then never falls back to rank-local metadata files.
        # DCP turns any error raised here into a bare AssertionError string. To hand users
        # the real error (type, attributes, traceback), keep it and raise it from
        # set_up_storage_reader, which DCP calls next and does not catch.
        self._deferred = self._bad_id  # every rank has it: none reaches a collective below
        self.sources, self._served = {}, {}
        self.bytes_read = {}
        if self._deferred is not None:
            return Metadata(state_dict_metadata={})
        try:
            return self._metadata_for_job()
        except TierstoreError as err:
            self._release()
            self._deferred = err
            return Metadata(state_dict_metadata={})

    def _protected(self, name: str | None, attempt: str | None = None) -> Manifest | None:
        """The manifest of ``name`` (``attempt``) this node's copies protect, if the store has
        them (:mod:`tierstore.redundancy`): found there, the checkpoint needs no cold request."""
        peers = self.store.peers
        if peers is None or name is None:
            return None
        try:
            manifest = peers.find_manifest(name)
        except InvalidManifest as err:
            log.warning("ignoring this node's copy of the manifest of %s: %s", name, err)
            return None
        if manifest is None or (attempt is not None and manifest.attempt != attempt):
            return None
        return manifest

    def _cold_disagrees(self, protected: Manifest) -> bool:
        """Whether the cold tier commits another attempt of ``protected``'s name (one that
        cannot be asked agrees: the copies are the catalog while it is down)."""
        cold = self.store.cold
        if cold is None:
            return False
        try:
            there = cold.find_manifest(protected.name)
        except TierstoreError as err:
            log.info(
                "reading %s from this node's copies: the cold tier did not answer (%s)", protected.name, err
            )
            return False
        return there is not None and there.attempt != protected.attempt

    def _resolve(self, exclude: Collection[tuple[str, str]] = ()) -> tuple[Manifest, list[Tier]]:
        """Pick the checkpoint and lease it; re-pick if a prune removed it meanwhile."""
        protected = self._protected(self.name, self.attempt)
        if protected is not None and self.attempt is None and self._cold_disagrees(protected):
            protected = None  # a stale attempt of the name among the copies: never read
        if protected is not None and self.store.peers is not None:
            return protected, [self.store.peers]
        committed_tiers = self.store.committed_tiers
        for _ in range(5):
            manifest, holders = resolve(committed_tiers, step=self.step, name=self.name, exclude=exclude)
            self._release()
            if self.lease:
                self._leases = [held for t in holders if (held := leases.take(t, manifest.name)) is not None]
            faults.point("reader.after_lease")
            # Leased first, checked second: a prune either sees our lease or we see it gone.
            alive = self.store.holders(manifest, among=holders)
            if alive:
                return manifest, alive
        raise CheckpointNotFound(
            "checkpoints kept disappearing while being picked (pruned?)",
            checkpoint=self.name,
            tier=", ".join(t.label for t in committed_tiers),
        )

    def release(self) -> None:
        """Release the leases this reader holds. A load releases them when its reads end;
        call this after a ``dcp.load`` that failed before reading (planning, another rank's
        error) to free them before they expire. Leases are only the coordinator's when the
        load was resolved once for the job."""
        self._release()

    def _release(self) -> None:
        for held in self._leases:
            held.release()
        self._leases = []

    def _metadata_for_job(self) -> Metadata:
        """:meth:`_read_metadata`, resolved once for the job.

        Under a process group of more than one rank (with ``resolve_once=True``), the
        coordinator (the group's rank 0) picks, leases and opens the checkpoint as a single
        process does, then broadcasts ``(name, attempt)`` or its error, which every other rank
        raises as its own; the others read that checkpoint's manifest by name, never listing,
        and take no lease: the coordinator's covers every rank until all reads are over
        (:meth:`_finish_reads`; docs/design.md invariant 16). Every rank reaches the broadcast
        on every path, errors included, so none is left waiting in it.
        """
        rank, world = _dist.group_rank_world(self._group)
        self._shared = self.resolve_once and world > 1
        if not self._shared:
            return self._read_metadata()
        if rank == 0:
            try:
                metadata = self._read_metadata()
            except BaseException as err:
                _dist.broadcast(_dist.Failure.of(err), self._group)
                raise
            assert self.manifest is not None
            _dist.broadcast((self.manifest.name, self.manifest.attempt), self._group)
            return metadata
        chosen = _dist.broadcast(None, self._group)
        if isinstance(chosen, _dist.Failure):
            raise chosen.rebuild()
        return self._open(*self._follow(*chosen))

    def _follow(self, name: str, attempt: str) -> tuple[Manifest, list[Tier]]:
        """The checkpoint the coordinator picked, by its manifest in each tier committing it."""
        protected = self._protected(name, attempt)
        if protected is not None and self.store.peers is not None:
            return protected, [self.store.peers]
        committed = self.store.committed_tiers
        found: list[tuple[Manifest, Tier]] = []
        invalid: list[InvalidManifest] = []
        for tier in committed:
            try:
                manifest = tier.find_manifest(name)
            except InvalidManifest as err:
                invalid.append(err)  # the coordinator read a valid one somewhere
                continue
            if manifest is not None and manifest.attempt == attempt:
                found.append((manifest, tier))
        if not found:
            if invalid:
                raise invalid[0]
            raise CheckpointNotFound(
                "the checkpoint the coordinator picked is no longer committed (pruned meanwhile?)",
                checkpoint=name,
                tier=", ".join(t.label for t in committed),
            )
        return found[0][0], [tier for _, tier in found]

    def _finish_reads(self) -> None:
        """End this rank's reads; release the leases once no rank reads any more. In a load
        resolved once for the job, only the coordinator holds a lease and it covers every
        rank's reads, so every rank (failed ones too) meets the others here first."""
        try:
            if self._shared:
                _dist.barrier(self._group)
        finally:
            self._release()

    def _read_metadata(self) -> Metadata:
        """Open the named checkpoint; without a name, the newest one that opens verified.

        Without a name, a candidate is skipped (warning naming it and what was wrong) when
        its ``.metadata`` is missing, damaged or unloadable in every tier holding it, one of
        its data files is missing or of the wrong size in every tier, or a part of its
        two-level manifest is missing (from listings: :func:`tierstore.dcp.listing.check_data_files`;
        bytes are checked only while streaming, in :meth:`read_data`). Candidates with a
        manifest invalid in every tier are never picked (:func:`tierstore.tiers.catalog.resolve`).
        If every candidate is damaged, the newest one's error is raised.
        """
        skipped: dict[tuple[str, str], TierstoreError] = {}
        while True:
            try:
                manifest, holders = self._resolve(skipped)
            except CheckpointNotFound:
                if not skipped:
                    raise
                break
            try:
                metadata = self._open(manifest, holders)
                if metadata.storage_data is None:
                    raise IntegrityError(
                        "DCP metadata has no storage data",
                        checkpoint=manifest.name,
                        file=manifest.metadata_file,
                    )
                if self.name is None:
                    check_data_files(manifest, holders, metadata.storage_data)
                return metadata
            except TierstoreError as err:
                if self.name is not None or not is_damage(err):
                    raise
                self._release()
                skipped[(manifest.name, manifest.attempt)] = err
                log.warning(
                    "skipping damaged checkpoint %s (it has no good copy in %s), trying "
                    "the next older one: %s",
                    manifest.name,
                    ", ".join(t.label for t in holders),
                    err,
                )
        raise next(iter(skipped.values()))

    def _open(self, manifest: Manifest, holders: list[Tier]) -> Metadata:
        if self.node_local:
            holders = [self.tiers[0], *holders]  # local files first, verified like any other
            peers, cold = self.store.peers, self.store.cold
            if peers is not None and peers not in holders:
                # This node's copies (and the files a load fetched from other nodes into them)
                # come right after its own files, whoever committed the checkpoint.
                holders.insert(1, peers)
            if holders[-1] is peers and cold is not None:
                # Found among this node's copies: the cold tier is the last resort for a file
                # no copy here holds, read at the same attempt and verified like any other.
                holders.append(cold)
        self.manifest, self._holders = manifest, holders
        entry = manifest.file(manifest.metadata_file)
        assert entry is not None  # validated with the manifest
        data = self._reads().read_small(entry)
        try:
            metadata = load_metadata(data)
        except pickle.UnpicklingError as err:
            served = self.sources.get(entry.path)
            raise IntegrityError(
                f"DCP metadata cannot be loaded safely: {err}",
                checkpoint=manifest.name,
                file=entry.path,
                tier=", ".join(t.label for t in holders if t.role == served),
            ) from err
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = str(uuid.uuid4())
        metadata.storage_meta = meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._deferred is not None:
            raise self._deferred
        if metadata.storage_data is None:
            raise IntegrityError("DCP metadata has no storage data", checkpoint=self._name())
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self.manifest is not None
        return dataclasses.replace(plan, storage_data=(self.manifest.name, self.manifest.attempt))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Each rank resolved "the newest checkpoint" on its own: make sure they agree.
        chosen = {plan.storage_data for plan in plans}
        if len(chosen) > 1:
            raise ConfigError(
                f"ranks resolved different checkpoints {sorted(chosen)} (a save committed "
                "while loading?); pass step= or name= to TieredReader"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        raw: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self._storage_info(item)
            per_file.setdefault(info.relative_path, []).append(item)
            if isinstance(info, RawItem):
                raw.setdefault(info.relative_path, []).append(item)
        if self.peer_fetch is not None and self.manifest is not None:
            # A collective: first, before anything here can raise and leave the others in it.
            self.peer_fetch(self.manifest, list(per_file))
        try:
            for path, items in per_file.items():
                if path in raw:
                    if len(raw[path]) != len(items):
                        raise IntegrityError(
                            "DCP metadata mixes encodings in one file", checkpoint=self._name(), file=path
                        )
                    continue
                faults.point("reader.before_file")
                self._reads().read_file(path, items, planner)
            if raw:
                self._reads().read_raw(raw, raw_read.Planner(planner))
        finally:
            self._finish_reads()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return layout.is_name(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return f"{redact_url(self.tiers[0].url)}#{self._name()}"

    # -- reading ------------------------------------------------------------------------

    def _name(self) -> str:
        if self.manifest is not None:
            return self.manifest.name
        return self.name or (f"step {self.step}" if self.step is not None else "latest")

    def _storage_info(self, item: ReadItem) -> Any:
        info = self._storage_data[item.storage_index]
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            if not isinstance(info, _StorageInfo):  # raw items are read in place, never transformed
                raise IntegrityError(
                    "a raw-encoded item claims DCP stream transforms",
                    checkpoint=self._name(),
                    file=info.relative_path,
                )
            try:
                self._transforms.extension_registry.from_descriptor_list(descriptors)
            except ValueError as err:
                raise ConfigError(
                    f"file was saved with DCP stream transforms {list(descriptors)} "
                    f"this reader cannot undo ({err}); pass _extension_registry= "
                    "with them registered (and their module installed)",
                    checkpoint=self._name(),
                    file=info.relative_path,
                ) from err
        return info

    def _reads(self) -> FileReads:
        assert self.manifest is not None
        return FileReads(
            self.manifest,
            self._holders,
            self._storage_data,
            self._transforms,
            node_local=self.node_local,
            thread_count=self.thread_count,
            lock=self._lock,
            bytes_read=self.bytes_read,
            sources=self.sources,
            served=self._served,
        )
