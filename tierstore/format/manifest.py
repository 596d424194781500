"""The manifest: the one mark of a complete checkpoint in a tier (docs/design.md invariant 1).

What a checkpoint is and every file of one attempt with its size, CRC32C and writing rank
(invariant 4); readers trust nothing it does not vouch for. Its value is a frozen
:class:`ManifestRoot`; the entries of a two-level manifest's parts sit in a :class:`PartIndex`,
a cache that reads them on demand. Its JSON forms and
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
``run`` (the run a save was named for), ``job`` (the scheduler's id of the job that saved, for
display) and ``fingerprint`` (of the saved state's structure) are written when known; a
manifest without them says nothing of its run or structure (docs/operations.md, "Runs").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast, overload

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
from tierstore.format.manifest_root import ManifestRoot, PartIndex, PartLoader
from tierstore.format.manifest_validation import validate_flat, validate_root

__all__ = [
    "FORMAT",
    "VERSION",
    "PART_RANKS",
    "MAX_MANIFEST_BYTES",
    "Checkpoint",
    "FileEntry",
    "Manifest",
    "ManifestRoot",
    "PartIndex",
    "PartRef",
    "PartLoader",
    "check_relpath",
    "checkpoint_order",
    "_checksum",
]

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


T = TypeVar("T")


class _OfRoot(Generic[T]):
    """A field of the manifest's root, read through the manifest (``manifest.step``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = name

    @overload
    def __get__(self, manifest: None, owner: type) -> _OfRoot[T]: ...

    @overload
    def __get__(self, manifest: Manifest, owner: type) -> T: ...

    def __get__(self, manifest: Manifest | None, owner: type) -> T | _OfRoot[T]:
        if manifest is None:
            return self
        return cast(T, getattr(manifest.root, self._field))


class Manifest:
    """A committed checkpoint: what it is, and every file that makes it up.

    ``Manifest(name=, step=, attempt=, world_size=, created=, files=, ...)`` builds one to
    publish; ``part_ranks`` (default :data:`PART_RANKS`) picks the form. Its value is
    :attr:`root`, a frozen :class:`ManifestRoot`; the entries of a two-level manifest's parts
    come from its :class:`PartIndex`, which reads them on demand. Equal manifests have equal
    roots (a two-level root vouches for its parts by digest); the fields are read-only.
    """

    __slots__ = ("_index", "root")

    root: ManifestRoot
    _index: PartIndex

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
        run: str | None = None,
        job: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        if not (isinstance(part_ranks, int) and part_ranks >= 1):
            raise ConfigError(f"part_ranks must be a positive int, got {part_ranks!r}")
        checked = fmt.check_metrics(metrics, source="new manifest", error=ConfigError) if metrics else {}
        for what, value in (("run", run), ("job", job)):
            if value is not None:
                fmt.check_run(value, what=what, source="new manifest", error=ConfigError)
        if fingerprint is not None:
            fmt.check_fingerprint(fingerprint, source="new manifest", error=ConfigError)
        files = tuple(files)
        fields: dict[str, Any] = dict(
            name=name,
            step=step,
            attempt=attempt,
            world_size=world_size,
            created=created,
            metadata_file=metadata_file,
            producer=producer,
            encoding=encoding,
            metrics=tuple(sorted(checked.items())),
            total_size=sum(f.size for f in files),
            num_files=len(files),
            run=run,
            job=job,
            fingerprint=fingerprint,
        )
        if len({f.rank for f in files}) <= part_ranks:
            self._bind(ManifestRoot(version=fmt.FLAT_VERSION, files=files, **fields))
            return
        meta = [f for f in files if f.path == metadata_file]
        if len(meta) != 1:
            raise ConfigError(
                f"new manifest: metadata file {metadata_file!r} is not listed once", checkpoint=name
            )
        refs, entries, encoded = [], {}, {}
        rest = [f for f in files if f.path != metadata_file]
        for index, (first, last, chunk) in enumerate(fmt.split_parts(rest, part_ranks, world_size)):
            data = fmt.encode_part(fmt.part_body(name, attempt, index, first, last, chunk))
            path = layout.manifest_part_path(index)
            refs.append(PartRef(index, path, first, last, len(chunk), len(data), fmt.digest(data)))
            entries[index], encoded[index] = chunk, data
        root = ManifestRoot(version=fmt.VERSION, metadata=meta[0], parts=tuple(refs), **fields)
        self._bind(root, PartIndex(root, entries=entries, encoded=encoded))

    def _bind(self, root: ManifestRoot, index: PartIndex | None = None) -> None:
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "_index", index if index is not None else PartIndex(root))

    @classmethod
    def _of(cls, root: ManifestRoot, index: PartIndex) -> Manifest:
        manifest = cls.__new__(cls)
        manifest._bind(root, index)
        return manifest

    def __getstate__(self) -> tuple[ManifestRoot, PartIndex]:
        return self.root, self._index

    def __setstate__(self, state: tuple[ManifestRoot, PartIndex]) -> None:
        self._bind(*state)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"a Manifest is read-only (setting {key!r})")

    def __repr__(self) -> str:
        root = self.root
        return (
            f"Manifest(name={root.name!r}, step={root.step!r}, attempt={root.attempt!r}, "
            f"world_size={root.world_size}, version={root.version}, files={root.num_files})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        return self.root == other.root

    def __hash__(self) -> int:
        return hash(self.root)

    # -- what a root knows (read through it) --------------------------------------------

    name: _OfRoot[str] = _OfRoot()
    step: _OfRoot[int | None] = _OfRoot()
    attempt: _OfRoot[str] = _OfRoot()
    world_size: _OfRoot[int] = _OfRoot()
    created: _OfRoot[float] = _OfRoot()
    metadata_file: _OfRoot[str] = _OfRoot()
    producer: _OfRoot[str] = _OfRoot()
    encoding: _OfRoot[str] = _OfRoot()
    version: _OfRoot[int] = _OfRoot()
    total_size: _OfRoot[int] = _OfRoot()
    num_files: _OfRoot[int] = _OfRoot()
    run: _OfRoot[str | None] = _OfRoot()  # the run named for the save; None: none named
    job: _OfRoot[str | None] = _OfRoot()  # the scheduler's id of the job that saved
    fingerprint: _OfRoot[str | None] = _OfRoot()  # of the saved structure (format.md)

    @property
    def metrics(self) -> dict[str, float]:
        """The metrics the save recorded (``{}`` when none), e.g. ``{"val_loss": 0.41}``."""
        return dict(self.root.metrics)

    @property
    def parts(self) -> tuple[PartRef, ...]:
        """The parts of a two-level manifest (empty for a flat one)."""
        return self.root.parts

    # -- entries -----------------------------------------------------------------------

    @property
    def files(self) -> tuple[FileEntry, ...]:
        """Every file, by rank then path; reads every part not read yet."""
        return self._index.all()

    def file(self, path: str) -> FileEntry | None:
        metadata = self.root.metadata
        if metadata is not None and path == metadata.path:
            return metadata
        if not self._index.complete():
            shard = _SHARD.fullmatch(path.rsplit("/", 1)[-1])
            ref = self._part_of(int(shard.group(1))) if shard else None
            if ref is not None:
                for entry in self._index.part(ref):
                    if entry.path == path:
                        return entry
        return self._index.by_path().get(path)

    def files_of_rank(self, rank: int) -> tuple[FileEntry, ...]:
        """Rank ``rank``'s files; of a two-level manifest, reads only that rank's part."""
        if not self.root.parts:
            return tuple(f for f in self.files if f.rank == rank)
        ref = self._part_of(rank)
        mine = [f for f in self._index.part(ref) if f.rank == rank] if ref is not None else []
        metadata = self.root.metadata
        if metadata is not None and metadata.rank == rank:
            mine.append(metadata)
        return tuple(sorted(mine, key=lambda f: f.path))

    def ranks(self) -> list[int]:
        """The ranks that own files, ascending (reads the parts not read yet)."""
        return sorted({f.rank for f in self.files})

    def _part_of(self, rank: int) -> PartRef | None:
        return next((ref for ref in self.root.parts if ref.covers(rank)), None)

    # -- JSON --------------------------------------------------------------------------

    def to_json(self) -> bytes:
        """The bytes to publish at the manifest key (flat, or the root), validated and
        self-checksummed."""
        root = self.root
        if root.version == fmt.FLAT_VERSION:
            body = fmt.flat_body(root.header(), root.metadata_file, self.files, root.encoding)
            validate_flat(body, source="new manifest", error=ConfigError)
            return fmt.encode_root(body)
        assert root.metadata is not None
        body = fmt.root_body(
            root.header(), root.metadata, root.total_size, root.num_files, root.parts, root.encoding
        )
        validate_root(body, source="new manifest", error=ConfigError)
        return fmt.encode_root(body)

    def part_json(self, ref: PartRef) -> bytes:
        """Part ``ref``'s bytes, as the root's digest vouches for them (read if need be)."""
        return self._index.encoded(ref)

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
                metadata, parts = validate_root(body, source="manifest", error=ValueError)
            else:
                files = validate_flat(body, source="manifest", error=ValueError)
        except ValueError as err:
            raise bad(str(err)) from err
        if recorded != _checksum(body):
            raise bad(f"self-checksum mismatch (recorded {recorded!r}); modified or corrupt")
        if expect_name is not None and body["name"] != expect_name:
            raise bad(f"names checkpoint {body['name']!r}, stored as {expect_name!r}")
        fields: dict[str, Any] = dict(
            name=body["name"],
            step=body["step"],
            attempt=body["attempt"],
            world_size=body["world_size"],
            created=body["created"],
            producer=body["producer"],
            encoding=body.get("encoding", "dcp"),
            metrics=tuple(sorted((k, float(v)) for k, v in body.get("metrics", {}).items())),
            version=body["version"],
            run=body.get("run"),
            job=body.get("job"),
            fingerprint=body.get("fingerprint"),
        )
        if body["version"] == fmt.VERSION:
            root = ManifestRoot(
                metadata_file=metadata.path,
                metadata=metadata,
                parts=parts,
                total_size=body["total_size"],
                num_files=body["file_count"],
                **fields,
            )
        else:
            root = ManifestRoot(
                metadata_file=body["metadata_file"],
                files=files,
                total_size=sum(f.size for f in files),
                num_files=len(files),
                **fields,
            )
        return cls._of(root, PartIndex(root, loader, (key, tier)))
