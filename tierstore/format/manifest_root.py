"""A manifest's root as a value, and the lazy index of its parts' entries.

:class:`ManifestRoot` is everything a manifest's root says (docs/design.md invariant 1),
frozen. :class:`PartIndex` holds what a two-level manifest's parts list, read the first
time an entry of theirs is asked for, through the tier that read the root. The two are
what :class:`tierstore.format.manifest.Manifest` is made of; nothing here does I/O but
through the loader it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format.manifest_format import FileEntry, PartRef
from tierstore.format.manifest_validation import validate_part

__all__ = ["ManifestRoot", "PartIndex", "PartLoader"]

PartLoader = Callable[[str, str, PartRef], tuple[str, bytes]]
"""Reads part ``ref`` of checkpoint ``name`` attempt ``attempt`` for a manifest: ``(key it was
read from, its bytes)``; raises
:class:`InvalidManifest` naming that key when the part is missing or oversized."""


@dataclass(frozen=True)
class ManifestRoot:
    """What a manifest's root says, as a value: every field set once, compared by all of them.

    A flat manifest's root carries its files (``files``); a two-level root carries the
    metadata file's entry, the parts' references (each with its digest) and the totals, and
    ``files`` is ``None``: the entries are in the parts (:class:`PartIndex`).
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
    metrics: tuple[tuple[str, float], ...]  # sorted by name
    total_size: int
    num_files: int
    files: tuple[FileEntry, ...] | None = None  # flat only
    metadata: FileEntry | None = None  # two-level only
    parts: tuple[PartRef, ...] = ()
    run: str | None = None  # the run the save was named for; None: none named
    job: str | None = None  # the scheduler's id of the job that saved; None: none known
    fingerprint: str | None = None  # of the saved state's structure; None: not recorded

    def header(self) -> dict[str, Any]:
        optional = {"run": self.run, "job": self.job, "fingerprint": self.fingerprint}
        return {
            "name": self.name,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "producer": self.producer,
            **({"metrics": dict(self.metrics)} if self.metrics else {}),
            **{key: value for key, value in optional.items() if value is not None},
        }


class PartIndex:
    """The entries of a manifest's parts, read the first time they are asked for.

    A cache, not a value: it starts with the parts a new manifest was split into, or with
    none for a root read from a store, and reads the others through ``loader`` (the tier that
    read the root: :meth:`tierstore.tiers.tier.Tier.read_part`), each verified against the
    root's digest before it is kept. Threads racing on one part both verify it; one copy stays.
    """

    def __init__(
        self,
        root: ManifestRoot,
        loader: PartLoader | None = None,
        source: tuple[str | None, str | None] = (None, None),
        entries: Mapping[int, tuple[FileEntry, ...]] | None = None,
        encoded: Mapping[int, bytes] | None = None,
    ) -> None:
        self._root, self._loader, self._source = root, loader, source
        self._entries: dict[int, tuple[FileEntry, ...]] = dict(entries or {})
        self._encoded: dict[int, bytes] = dict(encoded or {})
        self._all: tuple[FileEntry, ...] | None = root.files
        self._by_path: dict[str, FileEntry] | None = None

    @property
    def source(self) -> tuple[str | None, str | None]:
        """The root's key and tier, for errors (``None`` for a manifest built here)."""
        return self._source

    def part(self, ref: PartRef) -> tuple[FileEntry, ...]:
        entries = self._entries.get(ref.index)
        if entries is not None:
            return entries
        root = self._root
        if self._loader is None:
            raise ConfigError(
                "this two-level manifest was read without a tier to read its parts "
                "from (Manifest.from_json(..., loader=))",
                checkpoint=root.name,
            )
        key, data = self._loader(root.name, root.attempt, ref)
        try:
            entries = validate_part(
                data,
                ref,
                name=root.name,
                attempt=root.attempt,
                metadata_file=root.metadata_file,
                error=ValueError,
            )
        except ValueError as err:
            raise InvalidManifest(
                f"invalid manifest: {err}", key=key, tier=self._source[1], checkpoint=root.name
            ) from err
        self._encoded[ref.index] = data
        self._entries[ref.index] = entries
        return entries

    def encoded(self, ref: PartRef) -> bytes:
        self.part(ref)
        return self._encoded[ref.index]

    def all(self) -> tuple[FileEntry, ...]:
        if self._all is None:
            root = self._root
            entries = [e for ref in root.parts for e in self.part(ref)]
            assert root.metadata is not None
            entries.append(root.metadata)
            self._check_whole(entries)
            self._all = tuple(sorted(entries, key=lambda f: (f.rank, f.path)))
        return self._all

    def complete(self) -> bool:
        """Whether every entry is known without reading."""
        return self._all is not None

    def by_path(self) -> dict[str, FileEntry]:
        if self._by_path is None:
            self._by_path = {f.path: f for f in self.all()}
        return self._by_path

    def _check_whole(self, entries: Sequence[FileEntry]) -> None:
        """Across parts: no path twice, and the root's totals agree."""
        problem = None
        if len({e.path for e in entries}) != len(entries):
            problem = "a file is listed in two parts"
        elif sum(e.size for e in entries) != self._root.total_size:
            problem = f"the parts' sizes do not add up to the root's total_size {self._root.total_size}"
        if problem is not None:
            raise InvalidManifest(
                f"invalid manifest: {problem}",
                key=self._source[0],
                tier=self._source[1],
                checkpoint=self._root.name,
            )
