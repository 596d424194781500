"""The manifest's JSON forms, their strict validation, and the limits a save is held to.

Two forms (docs/format.md):

* **flat** (version 1): every file entry in the one manifest object. Every checkpoint whose
  files come from at most ``part_ranks`` ranks is written this way, byte for byte what
  earlier tierstore versions wrote, so they keep reading it.
* **two-level** (version 2): a small *root* at the manifest key (its exclusive publish is still
  the commit, docs/design.md invariant 2) and *parts*, each the entries of a contiguous rank
  range, stored with the attempt's files. The root vouches for each part by its sha256 and the
  part names its checkpoint, attempt and index, so a part swapped in from elsewhere is refused
  (invariant 4). A rank reads the root and its own part, never every rank's entries.

Here: the limits, the checks of one field (a path, metrics, a run name, a fingerprint), the
entries, and the encoders of each form, so every limit sits next to the encoder it bounds;
:mod:`tierstore.format.manifest_validation` is the strict reader of the same forms, built on
these limits and checks. No I/O here; :mod:`tierstore.format.manifest` holds the value built
from these forms.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format import layout

__all__ = [
    "FORMAT",
    "PART_FORMAT",
    "VERSION",
    "PART_RANKS",
    "MAX_METRICS",
    "MAX_STEP",
    "MAX_RUN",
    "FileEntry",
    "PartRef",
    "check_relpath",
    "check_metrics",
    "check_run",
    "is_run_text",
    "check_fingerprint",
    "structure_fingerprint",
    "flat_body",
    "root_body",
    "part_body",
    "split_parts",
    "encode_root",
    "encode_part",
    "digest",
    "check_plan",
]

FORMAT = "tierstore.manifest"
PART_FORMAT = "tierstore.manifest-part"
FLAT_VERSION = 1
VERSION = 2  # the newest form this tierstore reads
PART_RANKS = 1024  # ranks per part; a checkpoint of no more ranks keeps the flat form
MAX_MANIFEST_BYTES = 64 << 20  # a flat manifest or a root
MAX_PART_BYTES = 64 << 20
MAX_FILES = 1_000_000  # entries in a flat manifest, or in one part
MAX_PARTS = 1 << 16
MAX_FILE_SIZE = 1 << 50  # 1 PiB: anything larger is a forged or corrupt entry
MAX_WORLD_SIZE = 1 << 20
MAX_METRICS = 64  # metrics per checkpoint: a few scores, never a log
MAX_STEP = 1 << 62  # the largest step a manifest records (TieredWriter refuses more up front)
MAX_RUN = 128  # characters of a run name or a job id: a label, never a log
_CRC_MAX = (1 << 32) - 1
_PATH = re.compile(r"[A-Za-z0-9_.-]{1,255}(/[A-Za-z0-9_.-]{1,255}){0,7}")
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
_METRIC = re.compile(r"[A-Za-z0-9_./-]{1,64}")


def check_relpath(path: object) -> str:
    """A file path inside a checkpoint: relative, no ``.``/``..``, tame characters."""
    if (
        not isinstance(path, str)
        or not _PATH.fullmatch(path)
        or any(part in (".", "..") for part in path.split("/"))
    ):
        raise ValueError(f"unsafe file path {path!r}: must be relative and stay inside the checkpoint")
    return path


def check_metrics(metrics: object, *, source: str, error: type[Exception]) -> dict[str, float]:
    """Metrics as a manifest holds them: 1 to :data:`MAX_METRICS` names of
    ``[A-Za-z0-9_./-]{1,64}``, each a finite number (stored as a float); raises
    ``error(f"{source}: ...")`` otherwise. An empty mapping is "no metrics", never written."""
    need = _needer(source, error)
    need(
        isinstance(metrics, Mapping) and 0 < len(metrics) <= MAX_METRICS,
        f"metrics must be a mapping of 1 to {MAX_METRICS} names to numbers, got {_short(metrics)}",
    )
    assert isinstance(metrics, Mapping)
    for name, value in metrics.items():
        need(
            isinstance(name, str) and bool(_METRIC.fullmatch(name)),
            f"metric name {_short(name)} is not 1-64 characters of [A-Za-z0-9_./-]",
        )
        need(_finite(value), f"metric {name!r} is {_short(value)}, not a finite number")
    return {name: float(value) for name, value in metrics.items()}


def is_run_text(value: object) -> bool:
    """Whether ``value`` is what a manifest may hold as a ``run`` or ``job``: a string of 1 to
    :data:`MAX_RUN` printable characters (no control character), no ``/`` (it reads as a
    path), and no space at either end (``"a "`` and ``"a"`` would be two runs that print alike)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_RUN
        and value.isprintable()
        and "/" not in value
        and value == value.strip()
    )


def check_run(value: object, *, what: str, source: str, error: type[Exception]) -> str:
    """``value`` if :func:`is_run_text`; else ``error(f"{source}: ...")`` naming ``what``."""
    if not is_run_text(value):
        raise error(
            f"{source}: {what} {_short(value)} is not a run name: 1 to {MAX_RUN} printable "
            "characters, no '/' and no space at either end"
        )
    assert isinstance(value, str)
    return value


def check_fingerprint(value: object, *, source: str, error: type[Exception]) -> str:
    """A structure fingerprint as :func:`structure_fingerprint` writes it, else ``error``."""
    if not (isinstance(value, str) and _SHA256.fullmatch(value)):
        raise error(f"{source}: fingerprint {_short(value)} is not 'sha256:' and 64 lowercase hex digits")
    return value


def structure_fingerprint(items: Iterable[tuple[str, str | None, Sequence[int] | None]]) -> str:
    """The fingerprint of a saved state's structure (docs/format.md): ``items`` are
    ``(key, dtype, shape)`` for each key of DCP's global metadata, ``dtype`` a torch dtype's
    name without ``torch.`` (``"float32"``) and ``shape`` the global shape of a tensor, both
    ``None`` for bytes and objects. The SHA-256 of the canonical JSON of the sorted list of
    ``[key, "tensor", dtype, shape]`` and ``[key, "bytes"]``: the same structure always gives
    the same fingerprint, whatever the values and however tensors are sharded (keys of each
    rank's own, such as a ``TrainingState``'s RNG states, make it differ by world size)."""
    canonical = sorted(
        [key, "bytes"] if dtype is None else [key, "tensor", dtype, [int(n) for n in shape or ()]]
        for key, dtype, shape in items
    )
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _finite(value: object) -> bool:
    """A real number (NumPy's included) that is finite as a float. NaN and infinities: json.loads
    accepts them, and no "best" can be judged by them; a huge int would overflow ``float()``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if isinstance(value, numbers.Integral):
        return abs(int(value)) <= 1 << 1000
    return math.isfinite(float(value))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


Need = Callable[[bool, str], None]


def _needer(source: str, error: type[Exception]) -> Need:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise error(f"{source}: {what}")

    return need


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the attempt directory."""

    path: str
    size: int
    crc32c: int
    rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c, "rank": self.rank}


@dataclass(frozen=True)
class PartRef:
    """What a root says of one part: where it is, which ranks it covers, and its digest."""

    index: int
    path: str  # relative to the attempt, like a data file: the key differs by tier layout
    first_rank: int
    last_rank: int
    files: int
    size: int  # bytes of the part object
    sha256: str

    def covers(self, rank: int) -> bool:
        return self.first_rank <= rank <= self.last_rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "first_rank": self.first_rank,
            "last_rank": self.last_rank,
            "files": self.files,
            "size": self.size,
            "sha256": self.sha256,
        }


# -- building ---------------------------------------------------------------------------


def flat_body(
    header: Mapping[str, Any], metadata_file: str, files: Iterable[FileEntry], encoding: str
) -> dict[str, Any]:
    return {
        **header,
        "format": FORMAT,
        "version": FLAT_VERSION,
        "metadata_file": metadata_file,
        "files": [f.to_dict() for f in files],
        **({} if encoding == "dcp" else {"encoding": encoding}),
    }


def split_parts(
    files: Iterable[FileEntry], part_ranks: int, world_size: int
) -> list[tuple[int, int, tuple[FileEntry, ...]]]:
    """``(first_rank, last_rank, entries)`` per non-empty window of ``part_ranks`` ranks."""
    windows: dict[int, list[FileEntry]] = {}
    for entry in files:
        windows.setdefault(entry.rank // part_ranks, []).append(entry)
    return [
        (
            w * part_ranks,
            min((w + 1) * part_ranks, world_size) - 1,
            tuple(sorted(windows[w], key=lambda f: (f.rank, f.path))),
        )
        for w in sorted(windows)
    ]


def part_body(
    name: str, attempt: str, index: int, first: int, last: int, files: Iterable[FileEntry]
) -> dict[str, Any]:
    return {
        "format": PART_FORMAT,
        "version": VERSION,
        "name": name,
        "attempt": attempt,
        "index": index,
        "first_rank": first,
        "last_rank": last,
        "files": [f.to_dict() for f in files],
    }


def encode_part(body: Mapping[str, Any]) -> bytes:
    # Compact: a part holds ~1,024 ranks' entries and is read whole by each of them.
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def root_body(
    header: Mapping[str, Any],
    metadata: FileEntry,
    total_size: int,
    file_count: int,
    parts: Sequence[PartRef],
    encoding: str,
) -> dict[str, Any]:
    return {
        **header,
        "format": FORMAT,
        "version": VERSION,
        "encoding": encoding,
        "metadata": metadata.to_dict(),
        "total_size": total_size,
        "file_count": file_count,
        "parts": [p.to_dict() for p in parts],
    }


def encode_root(body: dict[str, Any]) -> bytes:
    """Either form at the manifest key: indented as version 1 always was, self-checksummed."""
    return json.dumps({**body, "checksum": checksum(body)}, indent=1, sort_keys=True).encode() + b"\n"


def checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


# -- limits, before any byte is written -------------------------------------------------


def _entry_bytes(path_len: int, indent: bool) -> int:
    """An upper bound of one entry's JSON (largest values; the flat form's indentation)."""
    worst = FileEntry("x" * path_len, MAX_FILE_SIZE, _CRC_MAX, MAX_WORLD_SIZE).to_dict()
    return len(json.dumps([worst], indent=1 if indent else None, separators=None if indent else (",", ":")))


# Header, metadata entry, checksum and producer (< 1 KiB each), the most metrics (a line of
# under 128 bytes each), and run and job (each at most MAX_RUN characters, 12 bytes apiece
# as JSON escapes an astral character, plus its key) and the fingerprint (< 128 bytes).
_RUN_BYTES = len(json.dumps("\U0010ffff" * MAX_RUN)) + 32
_HEADER_BYTES = 4096 + MAX_METRICS * 128 + 2 * _RUN_BYTES + 128


def check_plan(name: str, files_per_rank: Sequence[int], *, part_ranks: int, path_len: int) -> int:
    """Raise :class:`ConfigError` if the manifest of this save would break a limit; else
    return the number of parts it will have (0: the flat form).

    ``files_per_rank[r]`` is the number of files rank ``r`` writes, ``path_len`` the longest
    path. Bounds are for the worst entries, so a save that passes here never commits a
    manifest a reader refuses.
    """

    def fail(what: str) -> ConfigError:
        return ConfigError(
            f"the manifest of this save would exceed {what}; write fewer files per "
            "rank (single_file_per_rank=True) or use smaller manifest parts "
            "(manifest_part_ranks)",
            checkpoint=name,
        )

    ranks = sum(1 for n in files_per_rank if n)
    total = sum(files_per_rank) + 1  # + .metadata
    if ranks <= part_ranks:
        if total > MAX_FILES:
            raise fail(f"MAX_FILES ({MAX_FILES} files in one manifest) with {total} files")
        size = _HEADER_BYTES + total * _entry_bytes(path_len, indent=True)
        if size > MAX_MANIFEST_BYTES:
            raise fail(f"MAX_MANIFEST_BYTES ({MAX_MANIFEST_BYTES} bytes) with about {size} bytes")
        return 0
    windows = [sum(files_per_rank[lo : lo + part_ranks]) for lo in range(0, len(files_per_rank), part_ranks)]
    parts = sum(1 for n in windows if n)
    if parts > MAX_PARTS:
        raise fail(f"MAX_PARTS ({MAX_PARTS} parts) with {parts} parts")
    biggest = max(windows)
    if biggest > MAX_FILES:
        raise fail(f"MAX_FILES ({MAX_FILES} files in one part) with {biggest} files")
    part_size = 1024 + biggest * _entry_bytes(path_len, indent=False)
    if part_size > MAX_PART_BYTES:
        raise fail(f"MAX_PART_BYTES ({MAX_PART_BYTES} bytes in one part) with about {part_size} bytes")
    ref = PartRef(
        MAX_PARTS,
        layout.manifest_part_path(MAX_PARTS),
        MAX_WORLD_SIZE,
        MAX_WORLD_SIZE,
        MAX_FILES,
        MAX_PART_BYTES,
        "sha256:" + "f" * 64,
    )
    root_size = _HEADER_BYTES + parts * len(json.dumps([ref.to_dict()], indent=2))
    if root_size > MAX_MANIFEST_BYTES:
        raise fail(
            f"MAX_MANIFEST_BYTES ({MAX_MANIFEST_BYTES} bytes in the root) with about {root_size} bytes"
        )
    return parts
