"""The manifest: the one mark of a complete checkpoint in a tier (docs/design.md invariant 1).

A frozen value: what a checkpoint is and every file of one attempt with its size, CRC32C and
writing rank (invariant 4); readers trust nothing it does not vouch for. Its JSON forms and
their validation live in :mod:`tierstore.format.manifest_format`: flat (version 1) for a
checkpoint of at most ``part_ranks`` ranks, else a root (version 2) plus parts of about
``part_ranks`` ranks each. Read from a store, a two-level manifest holds only its root; a
part is read, through the loader of the tier that read the root, the first time an entry
of its ranks is asked for, verified against the root's sha256, and then kept. No I/O here.

``encoding`` says how the data files are laid out (:mod:`tierstore.format.encoding`). A flat
manifest writes it only when it is not "dcp", the format of every checkpoint written before
the field existed, so a dcp-encoded checkpoint's manifest stays readable by older versions.
``metrics`` (validation scores a save was given, for ``keep_best``) is likewise written only
when there are some, so a manifest without metrics is byte for byte what it was before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format import layout
from tierstore.format import manifest_format as fmt
from tierstore.format.manifest_format import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    PART_RANKS,
    VERSION,
    FileEntry,
    PartRef,
    check_relpath,
)
from tierstore.format.manifest_format import checksum as _checksum

__all__ = [
    "FORMAT",
    "VERSION",
    "PART_RANKS",
    "MAX_MANIFEST_BYTES",
    "Checkpoint",
    "FileEntry",
    "Manifest",
    "PartRef",
    "PartLoader",
    "check_relpath",
    "checkpoint_order",
    "_checksum",
]

PartLoader = Callable[[str, str, PartRef], tuple[str, bytes]]
"""Reads part ``ref`` of checkpoint ``name`` attempt ``attempt`` for a manifest: ``(key it was
read from, its bytes)``; raises
:class:`InvalidManifest` naming that key when the part is missing or oversized."""

_SHARD = re.compile(r"__(0|[1-9][0-9]{0,8})_[0-9]+\.distcp")


class Checkpoint(Protocol):
    """What ordering and retention see of a checkpoint (``CheckpointInfo`` and ``Manifest`` both fit)."""

    @property
    def step(self) -> int | None: ...
    @property
    def created(self) -> float: ...
    @property
    def name(self) -> str: ...


def checkpoint_order(checkpoint: Checkpoint) -> tuple[int, float, str]:
    """The one sort key of checkpoints, oldest first.

    By step, a checkpoint without one before step 0 (``step or -1`` would tie step 0 with
    them); then by creation time, then by name so that the order is total.
    """
    return (-1 if checkpoint.step is None else checkpoint.step, checkpoint.created, checkpoint.name)


@dataclass(frozen=True, eq=False, init=False)
class Manifest:
    """A committed checkpoint: what it is, and every file that makes it up.

    ``Manifest(name=, step=, attempt=, world_size=, created=, files=, ...)`` builds one to
    publish; ``part_ranks`` (default :data:`PART_RANKS`) picks the form. Equal manifests
    have equal roots (a two-level root vouches for its parts by digest).
    """

    name: str
    step: int | None
    attempt: str
    world_size: int
    created: float
    metadata_file: str
    producer: str
    encoding: str
    version: int
    _metrics: tuple[tuple[str, float], ...] = field(repr=False)  # sorted by name
    _all: tuple[FileEntry, ...] | None = field(repr=False)  # None: parts not all read yet
    _metadata: FileEntry | None = field(repr=False)
    _parts: tuple[PartRef, ...] = field(repr=False)
    _totals: tuple[int, int] = field(repr=False)  # total_size, file count
    _loaded: dict[int, tuple[FileEntry, ...]] = field(repr=False)
    _part_bytes: dict[int, bytes] = field(repr=False)
    _loader: PartLoader | None = field(repr=False)
    _source: tuple[str | None, str | None] = field(repr=False)  # root key and tier, for errors
    _index: dict[str, FileEntry] | None = field(repr=False)  # by path, once every entry is known

    def __init__(
        self,
        name: str,
        step: int | None,
        attempt: str,
        world_size: int,
        created: float,
        files: Sequence[FileEntry],
        metadata_file: str = layout.METADATA_FILE,
        producer: str = "",
        encoding: str = "dcp",
        *,
        part_ranks: int = PART_RANKS,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        if not (isinstance(part_ranks, int) and part_ranks >= 1):
            raise ConfigError(f"part_ranks must be a positive int, got {part_ranks!r}")
        checked = fmt.check_metrics(metrics, source="new manifest", error=ConfigError) if metrics else {}
        files = tuple(files)
        two_level = len({f.rank for f in files}) > part_ranks
        self._set(
            name=name,
            step=step,
            attempt=attempt,
            world_size=world_size,
            created=created,
            metadata_file=metadata_file,
            producer=producer,
            encoding=encoding,
            version=fmt.VERSION if two_level else fmt.FLAT_VERSION,
            _all=files,
            _metrics=tuple(sorted(checked.items())),
            _totals=(sum(f.size for f in files), len(files)),
            _loaded={},
            _part_bytes={},
            _loader=None,
            _source=(None, None),
            _metadata=None,
            _parts=(),
            _index=None,
        )
        if two_level:
            self._split(part_ranks)

    def _set(self, **values: Any) -> None:
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def _split(self, part_ranks: int) -> None:
        assert self._all is not None
        meta = [f for f in self._all if f.path == self.metadata_file]
        if len(meta) != 1:
            raise ConfigError(
                f"new manifest: metadata file {self.metadata_file!r} is not listed once", checkpoint=self.name
            )
        refs, loaded, encoded = [], {}, {}
        rest = [f for f in self._all if f.path != self.metadata_file]
        for index, (first, last, entries) in enumerate(fmt.split_parts(rest, part_ranks, self.world_size)):
            data = fmt.encode_part(fmt.part_body(self.name, self.attempt, index, first, last, entries))
            refs.append(
                PartRef(
                    index,
                    layout.manifest_part_path(index),
                    first,
                    last,
                    len(entries),
                    len(data),
                    fmt.digest(data),
                )
            )
            loaded[index], encoded[index] = entries, data
        self._set(_metadata=meta[0], _parts=tuple(refs), _loaded=loaded, _part_bytes=encoded)

    # -- what a root knows -------------------------------------------------------------

    @property
    def total_size(self) -> int:
        return self._totals[0]

    @property
    def num_files(self) -> int:
        return self._totals[1]

    @property
    def metrics(self) -> dict[str, float]:
        """The metrics the save recorded (``{}`` when none), e.g. ``{"val_loss": 0.41}``."""
        return dict(self._metrics)

    @property
    def parts(self) -> tuple[PartRef, ...]:
        """The parts of a two-level manifest (empty for a flat one)."""
        return self._parts

    def _header(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "producer": self.producer,
            **({"metrics": self.metrics} if self._metrics else {}),
        }

    def _identity(self) -> tuple[Any, ...]:
        header = {key: value for key, value in self._header().items() if key != "metrics"}
        return (
            tuple(sorted(header.items())),
            self._metrics,
            self.metadata_file,
            self.encoding,
            self.version,
            self._metadata,
            self._parts,
            self._totals,
            self._all if self.version == fmt.FLAT_VERSION else None,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    # -- entries -----------------------------------------------------------------------

    @property
    def files(self) -> tuple[FileEntry, ...]:
        """Every file, by rank then path; reads every part not read yet."""
        if self._all is None:
            entries = [e for ref in self._parts for e in self._part(ref)]
            assert self._metadata is not None
            entries.append(self._metadata)
            self._check_whole(entries)
            object.__setattr__(self, "_all", tuple(sorted(entries, key=lambda f: (f.rank, f.path))))
        assert self._all is not None
        return self._all

    def file(self, path: str) -> FileEntry | None:
        if self._metadata is not None and path == self._metadata.path:
            return self._metadata
        if self._all is None:
            shard = _SHARD.fullmatch(path.rsplit("/", 1)[-1])
            ref = self._part_of(int(shard.group(1))) if shard else None
            if ref is not None:
                for entry in self._part(ref):
                    if entry.path == path:
                        return entry
        return self._by_path().get(path)

    def _by_path(self) -> dict[str, FileEntry]:
        if self._index is None:
            object.__setattr__(self, "_index", {f.path: f for f in self.files})
        assert self._index is not None
        return self._index

    def files_of_rank(self, rank: int) -> tuple[FileEntry, ...]:
        """Rank ``rank``'s files; of a two-level manifest, reads only that rank's part."""
        if not self._parts:
            return tuple(f for f in self.files if f.rank == rank)
        ref = self._part_of(rank)
        mine = [f for f in self._part(ref) if f.rank == rank] if ref is not None else []
        if self._metadata is not None and self._metadata.rank == rank:
            mine.append(self._metadata)
        return tuple(sorted(mine, key=lambda f: f.path))

    def ranks(self) -> list[int]:
        """The ranks that own files, ascending (reads the parts not read yet)."""
        return sorted({f.rank for f in self.files})

    def _part_of(self, rank: int) -> PartRef | None:
        return next((ref for ref in self._parts if ref.covers(rank)), None)

    def _part(self, ref: PartRef) -> tuple[FileEntry, ...]:
        entries = self._loaded.get(ref.index)
        if entries is not None:
            return entries
        if self._loader is None:
            raise ConfigError(
                "this two-level manifest was read without a tier to read its parts "
                "from (Manifest.from_json(..., loader=))",
                checkpoint=self.name,
            )
        key, data = self._loader(self.name, self.attempt, ref)
        try:
            entries = fmt.validate_part(
                data,
                ref,
                name=self.name,
                attempt=self.attempt,
                metadata_file=self.metadata_file,
                error=ValueError,
            )
        except ValueError as err:
            raise InvalidManifest(
                f"invalid manifest: {err}", key=key, tier=self._source[1], checkpoint=self.name
            ) from err
        # Dict stores are atomic: threads racing on a part both verify it, one copy stays.
        self._part_bytes[ref.index] = data
        self._loaded[ref.index] = entries
        return entries

    def _check_whole(self, entries: Sequence[FileEntry]) -> None:
        """Across parts: no path twice, and the root's totals agree."""
        problem = None
        if len({e.path for e in entries}) != len(entries):
            problem = "a file is listed in two parts"
        elif sum(e.size for e in entries) != self.total_size:
            problem = f"the parts' sizes do not add up to the root's total_size {self.total_size}"
        if problem is not None:
            raise InvalidManifest(
                f"invalid manifest: {problem}",
                key=self._source[0],
                tier=self._source[1],
                checkpoint=self.name,
            )

    # -- JSON --------------------------------------------------------------------------

    def to_json(self) -> bytes:
        """The bytes to publish at the manifest key (flat, or the root), validated and
        self-checksummed."""
        if self.version == fmt.FLAT_VERSION:
            body = fmt.flat_body(self._header(), self.metadata_file, self.files, self.encoding)
            fmt.validate_flat(body, source="new manifest", error=ConfigError)
            return fmt.encode_root(body)
        assert self._metadata is not None
        body = fmt.root_body(
            self._header(), self._metadata, self.total_size, self.num_files, self._parts, self.encoding
        )
        fmt.validate_root(body, source="new manifest", error=ConfigError)
        return fmt.encode_root(body)

    def part_json(self, ref: PartRef) -> bytes:
        """Part ``ref``'s bytes, as the root's digest vouches for them (read if need be)."""
        self._part(ref)
        return self._part_bytes[ref.index]

    @classmethod
    def from_json(
        cls,
        data: bytes,
        *,
        key: str | None = None,
        tier: str | None = None,
        expect_name: str | None = None,
        loader: PartLoader | None = None,
    ) -> Manifest:
        """Parse and strictly validate a flat manifest or a root; :class:`InvalidManifest`
        names key and tier. A root's parts are read through ``loader`` when first needed."""

        def bad(reason: str) -> InvalidManifest:
            return InvalidManifest(f"invalid manifest: {reason}", key=key, tier=tier, checkpoint=expect_name)

        if len(data) > MAX_MANIFEST_BYTES:
            raise bad(f"{len(data)} bytes is larger than the {MAX_MANIFEST_BYTES} byte limit")
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            # RecursionError: a forged manifest of thousands of nested brackets
            raise bad(f"not valid JSON ({err}); truncated or corrupt?") from err
        if not isinstance(body, dict):
            raise bad("top level is not an object")
        recorded = body.pop("checksum", None)
        try:
            if body.get("version") == fmt.VERSION:
                metadata, parts = fmt.validate_root(body, source="manifest", error=ValueError)
            else:
                files = fmt.validate_flat(body, source="manifest", error=ValueError)
        except ValueError as err:
            raise bad(str(err)) from err
        if recorded != _checksum(body):
            raise bad(f"self-checksum mismatch (recorded {recorded!r}); modified or corrupt")
        if expect_name is not None and body["name"] != expect_name:
            raise bad(f"names checkpoint {body['name']!r}, stored as {expect_name!r}")
        manifest = cls.__new__(cls)
        manifest._set(
            name=body["name"],
            step=body["step"],
            attempt=body["attempt"],
            world_size=body["world_size"],
            created=body["created"],
            producer=body["producer"],
            encoding=body.get("encoding", "dcp"),
            _metrics=tuple(sorted((k, float(v)) for k, v in body.get("metrics", {}).items())),
            version=body["version"],
            _loaded={},
            _part_bytes={},
            _loader=loader,
            _source=(key, tier),
            _index=None,
        )
        if body["version"] == fmt.VERSION:
            manifest._set(
                metadata_file=metadata.path,
                _all=None,
                _metadata=metadata,
                _parts=parts,
                _totals=(body["total_size"], body["file_count"]),
            )
        else:
            manifest._set(
                metadata_file=body["metadata_file"],
                _all=files,
                _metadata=None,
                _parts=(),
                _totals=(sum(f.size for f in files), len(files)),
            )
        return manifest
