"""``TieredWriter``: a DCP ``StorageWriter`` whose commit is an atomically published manifest.

Call order (DCP's, across ranks) and what each step does here:

1. all ranks  ``reset(checkpoint_id)``, ``set_up_storage_writer``, ``prepare_local_plan``
2. coordinator ``prepare_global_plan``: refuses a checkpoint already committed in the hot
   tier or whose manifest would break a limit (docs/format.md: checked here, before any byte
   is written), picks a fresh attempt id and whether shards go to ``r<k>/`` subdirectories
   (:func:`~tierstore.format.layout.ranks_per_dir`), and hands both to every rank through
   ``SavePlan.storage_data``
3. all ranks  ``write_data``: each rank writes only its own files, under the attempt's
   directory, checksumming (CRC32C) as it writes and making each file durable (one
   directory fsync per rank, after its last file: ``Backend.sync_dirs``)
4. coordinator ``finish``: writes DCP's ``.metadata``, then publishes the manifest naming
   every file with size, CRC32C and rank (beyond ``manifest_part_ranks`` ranks: its parts,
   then its root). That publish is the commit (design.md invariants 1-3).

With a cold tier, each rank hands the files it wrote to this process's background migrator
as soon as they are durable, and the coordinator hands it the commit once the hot manifest
is published (see :mod:`tierstore.migration.migrator`). Nothing in migration can fail the save, and
no step of a save sends a request to the cold tier: a cold tier that is slow, stalled,
unreachable or denying writes never delays or fails a save (docs/design.md invariant 9).
The cold tier's own "never overwrite a committed checkpoint" check happens at the cold
commit, in the migrator, where a different committed attempt is a reported conflict.

Data files are raw-encoded by default (:mod:`tierstore.format.encoding`: each tensor's bytes
as they are, block checksums in the metadata); ``WriterOptions(encoding="dcp")`` writes what
``FileSystemWriter`` writes (one ``torch.save`` per item), which plain DCP readers load.

One ``StorageWriter``: DCP's call order above with the checks each step makes. How a rank's
items are spread over shard files and each file is written is :mod:`tierstore.dcp.shards`;
the dcp-encoded file layout :mod:`tierstore.dcp.dcp_files`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierstore import _dist, settings
from tierstore._redact import redact_url
from tierstore._version import producer
from tierstore.dcp import dcp_args, dcp_files, shards, structure
from tierstore.errors import CheckpointExists, ConfigError, NoSpaceLeft
from tierstore.format import layout
from tierstore.format import manifest_format as fmt
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.migration.migrator import MigrationOptions, Migrator
from tierstore.migration.workers import migrator_for
from tierstore.options import WriterOptions
from tierstore.storage import faults
from tierstore.tiers.tier import Store, Tier, TierURL

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; the annotations are never evaluated

__all__ = ["TieredWriter", "store_to_save"]

log = logging.getLogger(__name__)

_DCP_FORMAT_VERSION = "1.0.0"  # what FileSystemWriter stamps; keeps attempts plain DCP
MAX_FILES_PER_DIR = 4096  # hot directories larger than this slow down create, list, delete


def _setting(value: int | None, env: str, default: int, what: str) -> int:
    """An explicit option, else the environment variable ``env``, else ``default``: read when
    the writer is built, so a bad value fails there, not at the save."""
    if value is None:
        raw_value = settings.read(env) or ""
        try:
            value = int(raw_value) if raw_value else default
        except ValueError:
            raise ConfigError(f"{env}={raw_value!r} is not an int ({what})") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


def store_to_save(
    hot: TierURL | Store | None,
    cold: TierURL | None = None,
    *,
    owner: str,
) -> Store:
    """The store ``owner`` saves to: ``hot`` and ``cold`` as URLs, or a ``Store`` as ``hot``.
    It needs a hot tier (saves are written there first), and every tier's scheme is looked up
    now, so a typo or missing plugin fails here, once, not at each save."""
    store = Store.of(hot, cold)
    if store.hot is None:
        raise ConfigError(f"{owner} needs a hot tier: saves are written there first")
    store.check_schemes()
    return store


class TieredWriter(StorageWriter):
    """Save a DCP checkpoint into a tiered store (see the module docstring for the protocol).

    Args:
        hot: local path or URL of the hot tier, where every rank writes its shards; or a
            :class:`~tierstore.Store` (then without ``cold``), where the tiers need options
            (``Store.of(hot, cold, cold_options=...)``) or the hot tier is node-local
            (``Store.of(hot, cold, node_local=True)``: the free-space check is then per rank).
            ``path=`` (``FileSystemWriter``'s name for it) is the same.
        cold: optional URL of the cold tier (the migrator copies committed checkpoints there).
        step: training step; names the checkpoint ``step-<step>`` unless ``name`` is given.
        name: checkpoint name; a ``checkpoint_id`` given to ``dcp.save`` overrides it: a
            name, or a directory directly under a tier's root (``<hot>/<name>``).
        migration: how this process migrates to the cold tier (the first writer's wins).
        metrics: numbers recorded in the manifest (``CheckpointInfo.metrics``, ``keep_best``).
        run: the name of the run this save belongs to, recorded in the manifest as ``run``
            (1-128 printable characters, no ``/``); ``CheckpointManager(run=)`` resumes only
            checkpoints of its run. ``None`` (the default): no run is named. Either way the
            scheduler's id of the job (torchrun's ``TORCHELASTIC_RUN_ID``, else
            ``SLURM_JOB_ID``, ``PBS_JOBID``, ``LSB_JOBID``) is recorded as ``job``, for display.
        options: how the checkpoint is written (:class:`~tierstore.WriterOptions`: threads,
            encoding, manifest parts, files per directory).
        **filesystem_writer_args: ``FileSystemWriter``'s arguments (``path``,
            ``thread_count``, ``single_file_per_rank``, ``sync_files``,
            ``per_thread_copy_ahead``, ``cache_staged_state_dict``, ``overwrite``,
            ``_extensions``, ``serialization_format``), accepted with DCP's meaning
            (``thread_count``, ``single_file_per_rank`` and ``_extensions`` folded into
            ``options``) or refused with what to do instead (:mod:`tierstore.dcp.dcp_args`).
            Any other keyword is a ``TypeError``, naming what to write instead for one
            tierstore took before 0.1.0 (``node_local=``, ``cold_options=``, ``encoding=``, ...).

    A save whose manifest would break a limit (docs/format.md) fails before writing anything.

    A save that cannot fit in the hot tier's free space fails before writing anything.
    """

    def __init__(
        self,
        hot: TierURL | Store | None = None,
        cold: TierURL | None = None,
        *,
        step: int | None = None,
        name: str | None = None,
        migration: MigrationOptions | None = None,
        metrics: Mapping[str, float] | None = None,
        options: WriterOptions | None = None,
        run: str | None = None,
        **filesystem_writer_args: Unpack[dcp_args.FileSystemWriterArgs],
    ) -> None:
        super().__init__()
        self.options, self.overwrite = dcp_args.writer_options(options, filesystem_writer_args)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if step is not None and step > fmt.MAX_STEP:  # else refused at the commit, all data written
            raise ConfigError(f"step {step} is above the largest a manifest records, {fmt.MAX_STEP} (2**62)")
        self.step = step
        self.name = layout.check_name(name) if name is not None else None
        self.store = store_to_save(
            dcp_args.first_tier(hot, filesystem_writer_args, "TieredWriter"), cold, owner="TieredWriter"
        )
        self.tiers = self.store.tiers
        self.thread_count = self.options.thread_count
        self.single_file_per_rank = self.options.single_file_per_rank
        self.migration = migration
        self.node_local = self.store.node_local
        self.encoding: str = self.options.resolved_encoding
        self.extensions = tuple(self.options.extensions)
        self.metrics = fmt.check_metrics(metrics, source="metrics", error=ConfigError) if metrics else {}
        self.run = (
            None if run is None else fmt.check_run(run, what="run", source="TieredWriter", error=ConfigError)
        )
        self.job = _recorded_job()
        self.manifest_part_ranks = _setting(
            self.options.manifest_part_ranks,
            "TIERSTORE_MANIFEST_PART_RANKS",
            fmt.PART_RANKS,
            "manifest_part_ranks",
        )
        self.max_files_per_dir = _setting(
            self.options.max_files_per_dir,
            "TIERSTORE_MAX_FILES_PER_DIR",
            MAX_FILES_PER_DIR,
            "max_files_per_dir",
        )
        self.manifest: Manifest | None = None  # set on the coordinator once committed
        self._rank = 0
        self._is_coordinator = False
        self._plan: shards.AttemptPlan | None = None
        self._bad_id: ConfigError | None = None  # raised inside DCP's collectives, not reset()

    @property
    def hot(self) -> Tier:
        return self.tiers[0]

    @property
    def cold(self) -> Tier | None:
        return self.tiers[1] if len(self.tiers) > 1 else None

    @property
    def migrator(self) -> Migrator | None:
        """This process's migrator to the cold tier (``None`` without one)."""
        cold = self.cold
        return None if cold is None else migrator_for(self.hot, cold, self.migration)

    # -- DCP protocol --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # DCP calls reset() outside the collectives that wrap every rank's error into a
        # CheckpointException; a bad checkpoint_id is raised from the first step inside them.
        self._bad_id = None
        if checkpoint_id is not None:
            try:
                self.name = dcp_args.checkpoint_name(checkpoint_id, [t.url for t in self.tiers])
            except ConfigError as err:
                self._bad_id = err
        self.manifest = None
        self._plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._bad_id is not None:
            raise self._bad_id
        if not kwargs.get("use_collectives", True):
            raise ConfigError(
                "TieredWriter needs use_collectives=True: the coordinator's manifest must "
                "name every rank's files"
            )
        self._rank = kwargs.get("rank") or 0
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.node_local:
            self._check_space(shards.plan_bytes(plan), "this rank's shards")
        return plan

    def _check_space(self, needed: int, what: str) -> None:
        free = self.hot.backend.free_bytes()
        margin = needed // 50 + (1 << 20)  # torch.save framing, metadata, filesystem slack
        if free is not None and needed + margin > free:
            raise NoSpaceLeft(
                f"not enough free space for {what}: about {needed + margin} bytes needed, "
                f"{free} free; prune old checkpoints or free space first (nothing was written)",
                checkpoint=self.checkpoint_name,
                tier=self.hot.label,
            )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        name = self.checkpoint_name
        if not self.node_local:
            self._check_space(sum(shards.plan_bytes(p) for p in plans), "this checkpoint")
        per_dir = self._check_manifest_limits(name, plans)
        # Hot only: a request to the cold tier here would make every save wait on it.
        if self.hot.backend.exists(layout.manifest_key(name)):
            # DCP's own words first, for code and people that look for them.
            raise CheckpointExists(
                f"Checkpoint already exists and overwrite={self.overwrite}: the checkpoint is "
                "already committed, and committed checkpoints are never overwritten "
                "(docs/design.md invariant 3); choose another step or name",
                checkpoint=name,
                tier=self.hot.label,
            )
        # Grouped key prefixes on object stores (layout.file_key) for the raw encoding, which
        # needs this tierstore to read anyway; dcp-encoded attempts hash each file's whole path.
        attempt = layout.new_attempt(grouped=self.encoding == "raw")
        return [
            dataclasses.replace(
                plan, storage_data=shards.AttemptPlan(name, self.step, attempt, rank, per_dir)
            )
            for rank, plan in enumerate(plans)
        ]

    def _check_manifest_limits(self, name: str, plans: Sequence[SavePlan]) -> int:
        """Raise before any byte is written if the manifest could not hold this save (else
        it would commit, then be refused by every reader); return the ranks per directory."""
        counts = [self._files_of(plan) for plan in plans]
        widest = max(counts, default=0)
        per_dir = layout.ranks_per_dir(widest, len(plans), self.max_files_per_dir)
        longest = len(layout.data_file_name(max(len(plans) - 1, 0), max(widest - 1, 0), per_dir))
        fmt.check_plan(
            name,
            counts,
            part_ranks=self.manifest_part_ranks,
            path_len=max(longest, len(layout.METADATA_FILE)),
        )
        return per_dir

    def _files_of(self, plan: SavePlan) -> int:
        """How many shard files ``write_data`` writes for ``plan`` (its non-empty buckets)."""
        items = len(plan.items)
        return min(items, self.thread_count) if self.single_file_per_rank else items

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        attempt: shards.AttemptPlan = plan.storage_data
        self._plan = attempt
        buckets = (
            shards.split_by_size(self.thread_count, plan.items)
            if self.single_file_per_rank
            else [[item] for item in plan.items]
        )
        jobs = [
            (layout.data_file_name(attempt.rank, index, attempt.ranks_per_dir), items)
            for index, items in enumerate(b for b in buckets if b)
        ]

        def write(job: tuple[str, list[WriteItem]]) -> list[WriteResult]:
            return shards.write_file(
                self.hot, attempt, job[0], job[1], planner.resolve_data, self.encoding, self.extensions
            )

        with dcp_files.without_zip_crc32():
            if self.thread_count > 1 and len(jobs) > 1:
                with ThreadPoolExecutor(self.thread_count, thread_name_prefix="tierstore-write") as pool:
                    per_file = list(pool.map(write, jobs))
            else:
                per_file = [write(job) for job in jobs]
        # Each file was written with its directory entry's fsync deferred: one for them all,
        # before anyone can learn of the files (the migrator below, the manifest in finish).
        self.hot.backend.sync_dirs(self.hot.file_key(attempt.name, attempt.attempt, path) for path, _ in jobs)
        results = [result for results in per_file for result in results]
        migrator = self.migrator
        if migrator is not None and not self._is_coordinator:
            # Upload now: the files are durable, and in node-local mode no one else can.
            # The coordinator's files go with the commit, in finish().
            mine = [r.storage_data.file for r in results if r.storage_data.file is not None]
            migrator.submit_rank(attempt.name, attempt.attempt, attempt.step, attempt.rank, mine, fresh=True)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        attempt = self._plan
        if attempt is None:
            raise ConfigError("finish() called before write_data()")
        files: dict[str, FileEntry] = {}
        storage_data = {}
        for rank_results in results:
            for result in rank_results:
                item: shards.ItemResult = result.storage_data
                storage_data[result.index] = item.info
                if item.file is not None:
                    files[item.file.path] = item.file
        metadata.version = _DCP_FORMAT_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        files[layout.METADATA_FILE] = self._write_metadata(attempt, metadata)
        manifest = Manifest(
            name=attempt.name,
            step=attempt.step,
            attempt=attempt.attempt,
            world_size=len(results),
            created=time.time(),
            files=tuple(sorted(files.values(), key=lambda f: (f.rank, f.path))),
            producer=producer(),
            encoding=self.encoding,
            part_ranks=self.manifest_part_ranks,
            metrics=self.metrics,
            run=self.run,
            job=self.job,
            fingerprint=_fingerprint(metadata),
        )
        faults.point("writer.before_manifest_publish")
        self.hot.publish_manifest(manifest)  # COMMIT POINT (hot tier)
        self.manifest = manifest
        faults.point("writer.after_manifest_publish")
        migrator = self.migrator
        if migrator is not None:
            migrator.submit_commit(manifest, self._rank, fresh=True)

    def _write_metadata(self, attempt: shards.AttemptPlan, metadata: Metadata) -> FileEntry:
        key = self.hot.file_key(attempt.name, attempt.attempt, layout.METADATA_FILE)
        with self.hot.backend.open_write(key) as out:
            pickle.dump(metadata, out, protocol=pickle.HIGHEST_PROTOCOL)
        faults.point("writer.after_metadata_write")
        return FileEntry(layout.METADATA_FILE, out.size, out.crc32c, self._rank)

    def storage_meta(self) -> StorageMeta | None:
        attempt = self._plan.attempt if self._plan else None
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=attempt)

    @property
    def checkpoint_name(self) -> str:
        if self.name is not None:
            return self.name
        if self.step is not None:
            return layout.default_name(self.step)
        raise ConfigError("TieredWriter needs step=, name= or a checkpoint_id to name the checkpoint")

    @property
    def checkpoint_id(self) -> str:
        name = self.name or (layout.default_name(self.step) if self.step is not None else "?")
        return f"{redact_url(self.hot.url)}#{name}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return layout.is_name(checkpoint_id)


def _recorded_job() -> str | None:
    """The scheduler's id of this job as a manifest may hold it; one it may not (a torchrun
    run id of 200 characters, one with a ``/``) is left out, not a reason to fail a save."""
    job = _dist.job_id()
    if job is not None and not fmt.is_run_text(job):
        log.debug("not recording the job id %r in manifests: not a short printable label", job[:200])
        return None
    return job


def _fingerprint(metadata: Metadata) -> str | None:
    """The structure's fingerprint for the manifest; a metadata it cannot describe (a DCP of
    the future) leaves it out, never fails the commit."""
    try:
        return structure.of_metadata(metadata)
    except Exception:
        log.warning("not recording the state's structure fingerprint in the manifest", exc_info=True)
        return None
