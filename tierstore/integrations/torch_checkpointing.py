"""A tiered store as a ``torch_checkpointing`` storage: hot-tier writes, a manifest as the commit.

``CheckpointManager.Config(storage_config=TieredStorageConfig(hot="/nvme/ckpt", cold="s3://b/run"))``
and save to paths under ``hot`` (``manager.save("/nvme/ckpt/step_100", state)``). What maps to what:

- ``<hot>/<name>`` is the checkpoint ``<name>`` (step: the number it ends with); its files are
  the attempt's files in the hot tier (``checkpoints/<name>/<attempt>/<file>``), each durable
  and checksummed (size, CRC32C) as it is written, with a small record of that beside it;
- torch_checkpointing's writers write under ``<hot>/tmp_<name>`` and, after its barrier, rank 0
  renames that onto ``<hot>/<name>``: here the rename is the commit. It lists the records,
  checks every file is in place at its size and publishes the manifest (docs/design.md
  invariants 1 and 2), then hands the checkpoint to this process's migrator for the cold tier
  (invariant 9: the save never waits for it). An occupied destination (a committed name) is
  refused as the rename contract asks, never overwritten (invariant 3);
- reads resolve ``<hot>/<name>/<file>`` by manifest in the nearest tier holding it, every byte
  checked against the manifest (invariant 5); a damaged or missing copy falls back to the next
  tier, as :class:`~tierstore.TieredReader` does. A streamed read hands bytes out as they
  come, so where a farther tier could stand in, the copy is first checked whole (one more
  pass over the nearest copy, normally the local hot tier) before the stream starts; the
  last tier's copy is streamed and checked at its end;
- ``ls``/``exists``/``isdir``/``getsize`` answer from manifests: only committed checkpoints exist.

The attempt id is not drawn at random, as ``TieredWriter`` does: ranks write from their own
processes with nothing shared before the barrier, so every rank derives it from the checkpoint
name and the job's run id (``run_id``, else torchrun's run id and restart count, else Slurm's
job id and restart count; a 1-rank job without any draws one per process). Within a run a name
is saved once (a committed name is refused; the coordinator refuses a second commit of a name
pruned meanwhile), and a restarted job has a new run id, so attempts stay unique (invariant 3).
Its time field is zeros: no clock is shared either.

Limits: loads take no lease (torch_checkpointing gives a storage no start or end of a load), so
do not prune the checkpoint a job is loading; the coordinator lists and reads one small record
per file at the commit; HF consolidation's file renames are refused.

Why one module of about 470 lines: it is one drop-in, the storage class torch_checkpointing
loads by name, and its writer process, commit and streamed reads share that class's state.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from tierstore import _dist
from tierstore._redact import redact_url
from tierstore._version import producer
from tierstore.errors import CheckpointExists, ChecksumMismatch, ConfigError, IntegrityError, StorageError
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.format.verified import VerifiedStream, open_verified, verify_file
from tierstore.migration import workers
from tierstore.storage.backend import ObjectWriter
from tierstore.storage.registry import split_scheme
from tierstore.tiers.tier import Store, Tier

__all__ = ["TieredStorageConfig", "TieredStorage"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_RECORDS = ".tierstore-files"  # per-file records inside the attempt, deleted at the commit
_METADATA = "metadata.pkl"  # torch_checkpointing's distributed metadata, when it writes one
_TRAILING_STEP = re.compile(r"([0-9]+)$")
_RECORD_LIMIT = 1 << 16


@dataclass
class TieredStorageConfig(StorageConfig):
    """Where the store is; pickled to torch_checkpointing's writer processes."""

    hot: str  # a local directory: torch_checkpointing's paths are under it
    cold: str | None = None
    run_id: str | None = None  # the same on every rank, new for every job (see the module doc)
    temp_dir_prefix: str = "tmp_"  # CheckpointWriterConfig.temp_dir_prefix

    def create_storage(self) -> TieredStorage:
        return TieredStorage(self)


def _rank_world() -> tuple[int, int]:
    # The writer runs in torch_checkpointing's own process, where no process group is up.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _dist.rank_world()


def _run_id(configured: str | None, world: int) -> str:
    if configured:
        return configured
    for run, restarts in (
        ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
        ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
    ):
        if os.environ.get(run):
            return f"{os.environ[run]}:{os.environ.get(restarts, '0')}"
    if world == 1:
        return uuid.uuid4().hex
    raise ConfigError(
        "TieredStorageConfig needs run_id (the same on every rank, new for every job) "
        "outside torchrun and Slurm"
    )


class _Writing(io.RawIOBase):
    """One file being written to the hot tier; closing it makes it durable and records it."""

    def __init__(self, out: ObjectWriter, done: Any) -> None:
        self._out, self._done = out, done
        self._failed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def tell(self) -> int:
        return self._out.tell()

    def close(self) -> None:
        if not self.closed and not self._failed:
            self._out.close()
            self._done(self._out)
        super().close()

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self._failed = True
            self._out.abort()  # an aborted file is never recorded, so never committed
        self.close()


class _Reading(io.RawIOBase):
    """A stored file streamed through its CRC32C; the check happens at its end."""

    def __init__(self, stack: contextlib.ExitStack, stream: VerifiedStream) -> None:
        self._stack, self._stream = stack, stream
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._stream.readinto(memoryview(buffer).cast("B"))
        # Readers stop at the size they expect, never asking past it: check at the last byte.
        if not self._checked and (n == 0 or self._stream.pos >= self._stream.entry.size):
            self._checked = True
            self._stream.finish()
        return n

    def close(self) -> None:
        if not self.closed:
            self._stack.close()
        super().close()


class TieredStorage(Storage):
    """torch_checkpointing's ``Storage`` over a tiered store (see the module doc)."""

    def __init__(self, config: TieredStorageConfig) -> None:
        # Checked before abspath, which would turn any URL into a path under the cwd.
        if split_scheme(config.hot)[0] != "file" or "://" in config.hot:
            raise ConfigError(
                f"TieredStorageConfig.hot must be a local directory path, not a URL "
                f"(torch_checkpointing's paths are under it): {redact_url(config.hot)!r}"
            )
        self._config = config
        self._root = os.path.abspath(config.hot)
        self._store = Store.of(self._root, config.cold)
        self._store.check_schemes()
        self._checked: set[str] = set()  # names this process found uncommitted before writing
        self._committed: set[str] = set()  # names this process committed
        self._run: str | None = None

    @property
    def _hot(self) -> Tier:
        assert self._store.hot is not None
        return self._store.hot

    @property
    def mmap_fill_workers(self) -> int | None:
        return 1  # a verified read is one sequential pass

    # -- paths ------------------------------------------------------------------------

    def _parse(self, path: Path) -> tuple[str, str, str]:
        """``(kind, name, relpath)``: kind "root", "staging" or "committed"."""
        rel = os.path.relpath(os.path.abspath(path), self._root)
        if rel == ".":
            return "root", "", ""
        if rel.startswith(".."):
            raise ConfigError(f"{path} is outside the tiered store's hot directory {self._root}")
        top, _, rest = rel.replace(os.sep, "/").partition("/")
        prefix = self._config.temp_dir_prefix
        if top.startswith(prefix) and layout.is_name(top[len(prefix) :]):
            return "staging", top[len(prefix) :], rest
        return "committed", layout.check_name(top), rest

    def _attempt(self, name: str) -> str:
        if self._run is None:
            self._run = _run_id(self._config.run_id, _rank_world()[1])
        digest = hashlib.sha256(f"{self._run}/{name}".encode()).hexdigest()[:8]
        return layout.check_attempt(f"00000000T000000Z-{digest}")

    def _manifest(self, name: str) -> tuple[Manifest, list[Tier]] | None:
        """The nearest tier's manifest of ``name``, and the tiers to read it from in order."""
        tiers = self._store.tiers
        for index, tier in enumerate(tiers):
            manifest = tier.find_manifest(name)
            if manifest is not None:
                # A farther tier is asked only if a read fails: keys name the attempt, so a
                # tier without this attempt answers "not found" and the next one is tried.
                return manifest, [tier, *tiers[:index], *tiers[index + 1 :]]
        return None

    # -- writing ----------------------------------------------------------------------

    def stream_write(self, path: Path) -> io.IOBase:
        kind, name, rel = self._parse(path)
        if kind != "staging":
            raise PermissionError(
                f"{path}: only a checkpoint being written (under "
                f"{self._config.temp_dir_prefix}<name>) takes writes; keep "
                "CheckpointWriterConfig.write_to_temp_dir=True"
            )
        if name not in self._checked:
            if self._hot.backend.exists(layout.manifest_key(name)):
                raise CheckpointExists(
                    f"Checkpoint already exists: {name} is committed; "
                    "committed checkpoints are never overwritten",
                    checkpoint=name,
                    tier=self._hot.label,
                )
            self._checked.add(name)
        attempt = self._attempt(name)
        out = self._hot.backend.open_write(self._hot.file_key(name, attempt, rel))
        return _Writing(out, lambda done: self._record(name, attempt, rel, done))

    def _record(self, name: str, attempt: str, rel: str, out: ObjectWriter) -> None:
        rank, world = _rank_world()
        body = {"path": rel, "size": out.size, "crc32c": out.crc32c, "rank": rank, "world": world}
        key = self._hot.file_key(name, attempt, f"{_RECORDS}/{rel}.json")
        with self._hot.backend.open_write(key) as record:
            record.write(json.dumps(body).encode())

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as out:
            out.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self._parse(path)  # keys need no directories

    # -- the commit -------------------------------------------------------------------

    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool = False, background_cleanup: bool = False
    ) -> None:
        kind, name, rel = self._parse(src_path)
        dst = self._parse(dst_path)
        if not (is_directory and kind == "staging" and not rel and dst == ("committed", name, "")):
            raise OSError(
                f"cannot rename {src_path} to {dst_path}: the tiered store commits a "
                "whole checkpoint and renames nothing else"
            )
        if name in self._committed or self._hot.backend.exists(layout.manifest_key(name)):
            raise CheckpointExists(
                f"Checkpoint already exists: {name} was committed", checkpoint=name, tier=self._hot.label
            )
        manifest = self._manifest_of(name, self._attempt(name))
        self._hot.publish_manifest(manifest)  # the commit: invariants 1 and 2
        self._committed.add(name)
        records = [
            self._hot.file_key(name, manifest.attempt, f"{_RECORDS}/{f.path}.json") for f in manifest.files
        ]
        self._hot.backend.delete_many(records)
        if self._store.cold is not None:
            self._migrate(manifest)

    def _manifest_of(self, name: str, attempt: str) -> Manifest:
        world = _rank_world()[1]
        prefix = self._hot.file_key(name, attempt, _RECORDS + "/")
        entries = []
        for info in self._hot.backend.list(prefix):
            body = json.loads(self._hot.backend.read_bytes(info.key, limit=_RECORD_LIMIT))
            if body["world"] == world:  # another world's records are an earlier run's debris
                entries.append(FileEntry(body["path"], body["size"], body["crc32c"], body["rank"]))
        stored = {i.key: i.size for i in self._hot.backend.list(self._hot.file_key(name, attempt, ""))}
        for entry in entries:
            if stored.get(self._hot.file_key(name, attempt, entry.path)) != entry.size:
                raise IntegrityError(
                    f"{entry.path} is not in place at {entry.size} bytes; not committing",
                    checkpoint=name,
                    file=entry.path,
                    tier=self._hot.label,
                )
        if not entries:
            raise StorageError(f"nothing was written for {name}", checkpoint=name, tier=self._hot.label)
        paths = sorted(e.path for e in entries)
        step = _TRAILING_STEP.search(name)
        return Manifest(
            name=name,
            step=int(step[1]) if step else None,
            attempt=attempt,
            world_size=world,
            created=time.time(),
            files=sorted(entries, key=lambda e: e.path),
            metadata_file=_METADATA if _METADATA in paths else paths[0],
            producer=producer(),
        )

    def _migrate(self, manifest: Manifest) -> None:
        hot, cold = self._store.migration_pair()
        migrator = workers.migrator_for(hot, cold)
        # One process migrates every rank's files: queued in order, so each rank's upload
        # mark is published before the committing job waits for it.
        for rank in manifest.ranks():
            if rank != 0:
                migrator.submit_rank(
                    manifest.name, manifest.attempt, manifest.step, rank, manifest.files_of_rank(rank)
                )
        migrator.submit_commit(manifest, 0)

    # -- reading ----------------------------------------------------------------------

    def _entry(self, path: Path) -> tuple[FileEntry, Manifest, list[Tier]]:
        kind, name, rel = self._parse(path)
        found = self._manifest(name) if kind == "committed" else None
        entry = found[0].file(rel) if found is not None else None
        if entry is None or found is None:
            raise FileNotFoundError(f"{path}: no such file in a committed checkpoint")
        return entry, found[0], found[1]

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        entry, manifest, tiers = self._entry(path)
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self._read_whole(entry, manifest, tiers))  # type: ignore[return-value]

        def stream(tier: Tier, key: str, last: bool) -> io.RawIOBase:
            if not last:  # bytes handed out cannot be taken back: check before the first
                verify_file(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label)
            stack = contextlib.ExitStack()
            try:
                opened = stack.enter_context(
                    open_verified(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label)
                )
            except BaseException:
                stack.close()
                raise
            return _Reading(stack, opened)

        return self._from_nearest(entry, manifest, tiers, stream)

    def _read_whole(self, entry: FileEntry, manifest: Manifest, tiers: list[Tier]) -> bytes:
        def whole(tier: Tier, key: str, last: bool) -> bytes:
            with open_verified(tier.backend, key, entry, checkpoint=manifest.name, tier=tier.label) as stream:
                data = stream.read_exactly(entry.size)
                stream.finish()
            return data

        return self._from_nearest(entry, manifest, tiers, whole)

    def _from_nearest(
        self,
        entry: FileEntry,
        manifest: Manifest,
        tiers: list[Tier],
        consume: Callable[[Tier, str, bool], _T],
    ) -> _T:
        """``consume(tier, key, last)`` of the nearest good copy: a damaged or missing one
        falls back to the next tier; with none left, the last tier's error, naming
        checkpoint, file and tier (invariant 5; as ``TieredReader._from_nearest``)."""
        for index, tier in enumerate(tiers):
            key = tier.file_key(manifest.name, manifest.attempt, entry.path)
            last = index + 1 == len(tiers)
            try:
                # The stored size first: a truncated or missing copy fails before any read.
                stored = tier.backend.stat(key).size
                if stored != entry.size:
                    raise ChecksumMismatch.size(
                        entry.size, stored, checkpoint=manifest.name, file=entry.path, tier=tier.label
                    )
                return consume(tier, key, last)
            except (IntegrityError, StorageError) as err:
                if last:
                    raise
                log.warning(
                    "falling back to the next tier for file %s of checkpoint %s: %s",
                    entry.path,
                    manifest.name,
                    err,
                )
        raise AssertionError("a committed checkpoint is held by some tier")  # _manifest found one

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        entry, manifest, tiers = self._entry(path)
        return self._read_whole(entry, manifest, tiers)

    def exists(self, path: Path) -> bool:
        kind, name, rel = self._parse(path)
        if kind == "root":
            return True
        if kind == "staging":
            prefix = self._hot.file_key(name, self._attempt(name), _RECORDS + "/")
            return not rel and next(iter(self._hot.backend.list(prefix)), None) is not None
        return self.isdir(path) or self._file(name, rel) is not None

    def _file(self, name: str, rel: str) -> FileEntry | None:
        found = self._manifest(name)
        return found[0].file(rel) if found is not None and rel else None

    def isdir(self, path: Path) -> bool:
        kind, name, rel = self._parse(path)
        if kind != "committed":
            return kind == "root"
        found = self._manifest(name)
        return found is not None and (not rel or any(f.path.startswith(rel + "/") for f in found[0].files))

    def ls(self, path: Path) -> list[str]:
        kind, name, rel = self._parse(path)
        if kind == "root":
            return sorted({m.name for t in self._store.tiers for m in t.manifests()})
        found = self._manifest(name) if kind == "committed" else None
        if found is None:
            raise FileNotFoundError(f"{path}: no committed checkpoint")
        prefix = rel + "/" if rel else ""
        return sorted(
            {f.path[len(prefix) :].split("/")[0] for f in found[0].files if f.path.startswith(prefix)}
        )

    def getsize(self, path: Path) -> int:
        return self._entry(path)[0].size

    # -- what a store does not do -----------------------------------------------------

    def delete(self, path: Path) -> None:
        kind, name, rel = self._parse(path)
        if kind != "staging":
            raise PermissionError(
                f"{path}: committed checkpoints are immutable; prune them "
                "with a retention policy (tierstore prune)"
            )
        attempt = self._attempt(name)
        self._hot.backend.delete_many(
            [
                self._hot.file_key(name, attempt, rel),
                self._hot.file_key(name, attempt, f"{_RECORDS}/{rel}.json"),
            ]
        )

    def rmdir(self, path: Path) -> None:
        if self._parse(path)[0] != "staging":
            raise PermissionError(
                f"{path}: committed checkpoints are deleted by prune (tierstore prune), never by path"
            )

    def remap_path(self, path: Path) -> str:
        kind, name, rel = self._parse(path)
        return f"{self._hot.label}: {name}/{rel}" if kind != "root" else self._hot.label
