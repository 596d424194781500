"""The replay: W simulated ranks in one process, through tierstore's real code paths.

Phases, in order, each counted per actor (rank, or the coordinator) by
:mod:`benchmarks.scale.counting`:

- ``save``: DCP's save steps with :class:`~tierstore.TieredWriter` (hot tier only, so no
  upload runs during the save): per rank ``set_up_storage_writer``/``prepare_local_plan``,
  the coordinator's ``prepare_global_plan`` (DCP's planner dedups the replicated items),
  per rank ``write_data``, the coordinator's ``finish`` (the hot commit).
- ``cold``: each rank's migrator job (``Migrator.submit_rank``, as the writer hands it over),
  then the coordinator's commit job (``submit_commit``: marks, checks, the cold manifest).
- ``status``, ``list``: ``migration_status`` and ``list_checkpoints``, from the coordinator.
- ``load``: DCP's load steps with :class:`~tierstore.TieredReader` for a sample of ranks
  (every rank up to ``load_sample``): the coordinator resolves the newest checkpoint and
  holds the job's one lease; the others are handed its name, as the coordinator's broadcast
  would, and read only that checkpoint (issue 15's "resolve once").
- ``prune``: after a second, one-rank checkpoint is saved and migrated (not counted), prune
  with ``keep_last(1)`` in both tiers deletes the W-rank checkpoint.
- ``gc``: ``collect_garbage`` with no grace period.

:func:`simulate_cold` runs the ``cold`` phase alone, over an attempt written straight to the
hot tier, fresh or resumed: ``make test`` checks the cold commit's budgets at W = 4,096 with it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.scale import workload
from benchmarks.scale.counting import COORDINATOR, RequestCounter, counting_backend
from tierstore.dcp.reader import TieredReader
from tierstore.dcp.writer import TieredWriter
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.migrator import MigrationOptions, Migrator
from tierstore.migration.status import migration_status
from tierstore.migration.transfer import copy_file
from tierstore.storage.backend import Backend
from tierstore.storage.registry import open_backend
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.tier import Store, Tier

__all__ = ["SimConfig", "SimRun", "simulate", "simulate_cold", "PHASES", "tree_part_ranks", "load_sample"]

log = logging.getLogger(__name__)

PHASES = ("save", "cold", "status", "list", "load", "prune", "gc")
FILES_PER_RANK = 2  # thread_count=2: each rank's two own tensors go to two files
PART_RANKS_DEFAULT = 1024


@dataclass(frozen=True)
class SimConfig:
    """One simulated job: ``world`` ranks, a hot and a cold tier (URL and options)."""

    world: int
    hot_url: str
    cold_url: str
    cold_options: Mapping[str, Any] = field(default_factory=dict)
    load_sample: int = 64  # ranks replayed on load (all when world is smaller)
    part_ranks: int | None = None  # manifest ranks per part, where the writer takes it


@dataclass
class SimRun:
    """What a replay measured: the counter, and each loaded rank's plan bytes."""

    config: SimConfig
    counter: RequestCounter
    manifest: Manifest
    plan_bytes: dict[int, int] = field(default_factory=dict)
    files_per_rank: dict[int, int] = field(default_factory=dict)
    reader_bytes: dict[int, dict[str, int]] = field(default_factory=dict)


class CountedTier(Tier):
    """A tier whose backend is a counting wrapper around the real one."""

    def __init__(self, role: str, url: str, options: Mapping[str, Any], backend: Backend) -> None:
        super().__init__(role, url, options)
        self._counted = backend

    @property
    def backend(self) -> Backend:
        return self._counted


class Tiers:
    """Fresh tiers for each simulated process, over one open backend per tier.

    Each rank of a real job is its own process: whatever a :class:`Tier` keeps in memory
    (parsed manifests) one rank read, another rank never sees. Sharing the backends (which
    keep nothing about checkpoints) only saves opening a client per rank.
    """

    def __init__(self, config: SimConfig, counter: RequestCounter) -> None:
        self.counter = counter
        self._spec = {"hot": (config.hot_url, {}), "cold": (config.cold_url, config.cold_options)}
        self._open = {
            role: counting_backend(open_backend(url, options, label=role), counter, role)
            for role, (url, options) in self._spec.items()
        }

    def tier(self, role: str) -> Tier:
        url, options = self._spec[role]
        return CountedTier(role, url, options, self._open[role])

    def store(self, *, cold: bool = True) -> Store:
        return Store.of_tiers(self.tier("hot"), self.tier("cold") if cold else None)

    def close(self) -> None:
        for backend in self._open.values():
            backend.close()


def tree_part_ranks() -> int:
    """The tree's ranks per manifest part (1,024 where the two-level manifest is absent)."""
    for module in ("tierstore.format.manifest", "tierstore.format.manifest_format"):
        try:
            value = getattr(importlib.import_module(module), "PART_RANKS", None)
        except ImportError:
            continue
        if isinstance(value, int):
            return value
    return PART_RANKS_DEFAULT


def accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a keyword ``name`` (features that may not have landed yet)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def simulate(config: SimConfig) -> SimRun:
    """Run every phase once (module docstring); raises if any step fails."""
    counter = RequestCounter()
    tiers = Tiers(config, counter)
    try:
        manifest, files = _save(tiers, config, "big", step=1)
        run = SimRun(
            config, counter, manifest, files_per_rank={r: len(manifest.files_of_rank(r)) for r in files}
        )
        _migrate(tiers, manifest, files, "cold")
        with counter.step("status", COORDINATOR):
            migration_status(tiers.store())
        with counter.step("list", COORDINATOR):
            listed = list_checkpoints(tiers.store())
        assert [c.name for c in listed] == ["big"], listed
        _load(tiers, run)
        _prune_and_gc(tiers, config)
    finally:
        tiers.close()
    return run


def simulate_cold(config: SimConfig, *, resumed: bool = False) -> SimRun:
    """The ``cold`` phase alone, in seconds at W = 4,096 (``make test`` checks its budgets
    with it): DCP's planning, what makes a large W slow, is left out, and the attempt is
    written straight to the hot tier as the writer leaves it (F files per rank, rank 0's
    ``.metadata``, the hot manifest). Then each rank's upload job and the coordinator's
    commit job, as the writer submits them after a save; or, ``resumed``, as a migration
    resuming a pending checkpoint does (the manager at its start, ``tierstore migrate``),
    after a crash that left every odd rank's files uploaded but not marked."""
    counter = RequestCounter()
    tiers = Tiers(config, counter)
    try:
        hot, cold = tiers.tier("hot"), tiers.tier("cold")
        manifest, files = _write_attempt(hot, config)
        if resumed:  # uncounted: what the crashed run did
            for rank in range(1, config.world, 2):
                for entry in files[rank]:
                    copy_file(hot, cold, manifest.name, manifest.attempt, entry)
        run = SimRun(
            config, counter, manifest, files_per_rank={r: len(manifest.files_of_rank(r)) for r in files}
        )
        _migrate(tiers, manifest, files, "cold", resumed=resumed)
    finally:
        tiers.close()
    return run


def _write_attempt(hot: Tier, config: SimConfig) -> tuple[Manifest, dict[int, list[FileEntry]]]:
    """A committed hot attempt of ``config.world`` ranks, and each rank's own files."""
    name, attempt = "big", layout.new_attempt(grouped=True)  # grouped, as the raw encoding's
    files: dict[int, list[FileEntry]] = {}

    def write(path: str, rank: int, data: bytes) -> FileEntry:
        with hot.backend.open_write(hot.file_key(name, attempt, path)) as out:
            out.write(data)
        return FileEntry(path, len(data), out.crc32c, rank)

    for rank in range(config.world):
        data = rank.to_bytes(4, "little") * workload.OWN_NUMEL  # 4 KiB, as a rank's tensor
        files[rank] = [write(layout.data_file_name(rank, i), rank, data) for i in range(FILES_PER_RANK)]
    metadata = write(layout.METADATA_FILE, 0, b"DCP's metadata, rank 0's file")
    manifest = Manifest(
        name=name,
        step=1,
        attempt=attempt,
        world_size=config.world,
        created=time.time(),
        files=sorted([metadata, *(f for fs in files.values() for f in fs)], key=lambda f: (f.rank, f.path)),
        producer="benchmarks.scale",
        part_ranks=config.part_ranks or tree_part_ranks(),
    )
    hot.publish_manifest(manifest)  # the hot commit
    return manifest, files


def _reader(**options: Any) -> dict[str, Any]:
    """``TieredReader`` keywords for ``options``: its ``ReaderOptions`` where the tree has them."""
    try:
        from tierstore.options import ReaderOptions
    except ImportError:  # older trees took them as keywords
        return options
    return {"options": ReaderOptions(**options)}


def _writer(store: Store, config: SimConfig, name: str, step: int) -> TieredWriter:
    extra: dict[str, Any] = {}
    if config.part_ranks is not None:
        try:  # the options object, else the keyword older trees took, else not landed
            from tierstore.options import WriterOptions

            extra["options"] = WriterOptions(manifest_part_ranks=config.part_ranks)
        except ImportError:
            if accepts(TieredWriter, "manifest_part_ranks"):
                extra["manifest_part_ranks"] = config.part_ranks
    return TieredWriter(store, name=name, step=step, thread_count=FILES_PER_RANK, **extra)


def _save(
    tiers: Tiers,
    config: SimConfig,
    name: str,
    *,
    step: int,
    world: int | None = None,
    phase: str | None = "save",
) -> tuple[Manifest, dict[int, list[FileEntry]]]:
    """DCP's save steps; hot only, so the writer hands nothing to a migrator."""
    world, counter = config.world if world is None else world, tiers.counter
    writers = [_writer(tiers.store(cold=False), config, name, step) for _ in range(world)]
    planners, local = [], []
    for rank, writer in enumerate(writers):
        with counter.step(phase, rank):
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            planner = workload.save_planner(rank, writer.storage_meta())
            planners.append(planner)
            local.append(writer.prepare_local_plan(planner.create_local_plan()))
    with counter.step(phase, COORDINATOR):
        plans, metadata = planners[0].create_global_plan(local)
        plans = writers[0].prepare_global_plan(plans)
    results, files = [], {}
    for rank, writer in enumerate(writers):
        with counter.step(phase, rank):
            final = planners[rank].finish_plan(plans[rank])
            results.append(writer.write_data(final, planners[rank]).wait())
        files[rank] = [
            r.storage_data.file for r in results[-1] if getattr(r.storage_data, "file", None) is not None
        ]
    with counter.step(phase, COORDINATOR):
        writers[0].finish(metadata, results)
    assert writers[0].manifest is not None
    return writers[0].manifest, files


def _migrator(tiers: Tiers) -> Migrator:
    # A short commit timeout: every mark is there before the commit job starts, so a wait
    # would only mean a mark went missing (a bug the replay must report, not sit out).
    return Migrator(
        tiers.tier("hot"), tiers.tier("cold"), MigrationOptions(poll_interval=0.05, commit_timeout=120.0)
    )


def _migrate(
    tiers: Tiers,
    manifest: Manifest,
    files: Mapping[int, Sequence[FileEntry]],
    phase: str | None,
    *,
    resumed: bool = False,
) -> None:
    """Each rank's upload job (its own process's migrator), then the coordinator's commit:
    as the writer submits them (``fresh``), or as a resumed migration does (``resumed``)."""
    counter, failed = tiers.counter, []
    fresh = {"fresh": True} if not resumed and accepts(Migrator.submit_rank, "fresh") else {}
    for rank in sorted(r for r in files if r != 0):
        migrator = _migrator(tiers)
        with counter.step(phase, rank):
            migrator.submit_rank(manifest.name, manifest.attempt, manifest.step, rank, files[rank], **fresh)
            migrator.close()
        failed += migrator.failures()
    migrator = _migrator(tiers)
    own_keys = {
        t.file_key(manifest.name, manifest.attempt, f.path)
        for t in (migrator.hot, migrator.cold)
        for f in manifest.files_of_rank(0)
    }
    counter.own_upload = lambda key: key in own_keys or _rank_of_mark(key) == 0
    try:
        with counter.step(phase, COORDINATOR):
            commit_fresh = fresh if accepts(Migrator.submit_commit, "fresh") else {}
            migrator.submit_commit(manifest, 0, **commit_fresh)
            migrator.close()
    finally:
        counter.own_upload = None
    failed += migrator.failures()
    if failed:
        raise RuntimeError(f"migration failed in the replay: {failed[0]}")


def _rank_of_mark(key: str) -> int | None:
    try:
        parsed = layout.parse_upload_key(key)
    except Exception:  # a mark layout this probe does not know: not the rank's own
        return None
    return None if parsed is None else parsed[2]


def load_sample(world: int, sample: int) -> list[int]:
    """The ranks replayed on load: all, or ``sample`` of them (0, 1 and the last included)."""
    if world <= sample:
        return list(range(world))
    rng = random.Random(world)  # the same sample on every run
    chosen = {0, 1, world - 1} | set(rng.sample(range(2, world - 1), sample - 3))
    return sorted(chosen)


def _load(tiers: Tiers, run: SimRun) -> None:
    counter, ranks = run.counter, load_sample(run.config.world, run.config.load_sample)
    readers: dict[int, TieredReader] = {}
    planners, targets, local, metadata_of = {}, {}, [], {}
    name = run.manifest.name
    for rank in ranks:
        with counter.step("load", rank):
            # The coordinator resolves and leases; the others get the name it would broadcast.
            reader = TieredReader(tiers.store(), name=None if rank == 0 else name, **_reader(lease=rank == 0))
            metadata = metadata_of[rank] = reader.read_metadata()
            reader.set_up_storage_reader(metadata, rank == 0)
            targets[rank] = workload.empty_like_state(rank)
            planners[rank] = workload.load_planner(rank, targets[rank], metadata)
            local.append(reader.prepare_local_plan(planners[rank].create_local_plan()))
            readers[rank] = reader
    with counter.step("load", COORDINATOR):
        plans = readers[0].prepare_global_plan(planners[0].create_global_plan(local))
    for rank, plan in zip(ranks, plans):
        with counter.step("load", rank):
            final = planners[rank].finish_plan(plan)
            readers[rank].read_data(final, planners[rank]).wait()
        workload.check_loaded(rank, targets[rank])
        run.plan_bytes[rank] = workload.plan_bytes(final, metadata_of[rank])
        read = getattr(readers[rank], "bytes_read", None)
        if isinstance(read, Mapping):
            run.reader_bytes[rank] = {str(k): int(v) for k, v in read.items()}


def _prune_and_gc(tiers: Tiers, config: SimConfig) -> None:
    counter = tiers.counter
    small, files = _save(tiers, config, "small", step=2, world=1, phase=None)
    _migrate(tiers, small, files, None)
    with counter.step("prune", COORDINATOR):
        reports = prune(tiers.store(), hot_policy=keep_last(1), cold_policy=keep_last(1))
    deleted = sorted({name for r in reports for name in r.deleted})
    errors = [e for r in reports for e in r.errors]
    if errors or deleted != ["big"]:
        raise RuntimeError(f"prune in the replay: deleted {deleted}, errors {errors}")
    with counter.step("gc", COORDINATOR):
        collect_garbage(tiers.store(), grace=0.0, dry_run=False)
