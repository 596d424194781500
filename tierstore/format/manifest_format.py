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

No I/O here; :mod:`tierstore.format.manifest` holds the value built from these forms.

Why one module of about 500 lines: the schema of both forms sits in one place, each field's
validation and limit next to the encoder that writes it, so the writer and the strict reader
cannot drift apart.
"""

from __future__ import annotations

import hashlib
import itertools
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
    "validate_flat",
    "validate_root",
    "validate_part",
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
_HEADER = {"format", "version", "name", "step", "attempt", "world_size", "created", "producer"}
_FLAT_KEYS = _HEADER | {"metadata_file", "files"}
_ROOT_KEYS = _HEADER | {"encoding", "metadata", "total_size", "file_count", "parts"}
_PART_KEYS = {"format", "version", "name", "attempt", "index", "first_rank", "last_rank", "files"}
# Absent means: "dcp"; no metrics; no run named, no job known, structure unknown (written
# before these existed, or nothing to record).
_RUN_KEYS = {"run", "job", "fingerprint"}
_OPTIONAL_KEYS = {"encoding", "metrics"} | _RUN_KEYS  # flat form
_ROOT_OPTIONAL_KEYS = {"metrics"} | _RUN_KEYS
_FILE_KEYS = {"path", "size", "crc32c", "rank"}
_REF_KEYS = {"path", "first_rank", "last_rank", "files", "size", "sha256"}
_ENCODINGS = ("dcp", "raw")  # tierstore.format.encoding.ENCODINGS; "dcp" when absent


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


# -- validation (each raises ``error(f"{source}: ...")``) --------------------------------

Need = Callable[[bool, str], None]


def _needer(source: str, error: type[Exception]) -> Need:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise error(f"{source}: {what}")

    return need


def _is_int(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _check_version(body: Mapping[str, Any], fmt: str, need: Need) -> None:
    need(body.get("format") == fmt, f"format is {body.get('format')!r}, not {fmt!r}")
    version = body.get("version")
    need(
        _is_int(version, 1, VERSION),
        f"version {version!r} is not supported (this tierstore reads up to {VERSION}); "
        "written by a newer tierstore?",
    )


def _check_keys(body: Mapping[str, Any], expected: set[str], optional: set[str], need: Need) -> None:
    keys = set(body) - optional
    need(keys == expected, f"fields {sorted(keys ^ expected)} missing or unexpected")


def _check_header(body: Mapping[str, Any], need: Need) -> None:
    try:
        layout.check_name(body["name"])
        layout.check_attempt(body["attempt"])
    except ConfigError as err:
        need(False, err.message)
    need(body["step"] is None or _is_int(body["step"], 0, MAX_STEP), "step is not a non-negative int")
    need(_is_int(body["world_size"], 1, MAX_WORLD_SIZE), "world_size is not a positive int")
    created = body["created"]
    need(
        isinstance(created, (int, float))
        and not isinstance(created, bool)
        and math.isfinite(created)
        and created >= 0,
        "created is not a timestamp",
    )
    need(isinstance(body["producer"], str) and len(body["producer"]) < 1024, "producer is not a short string")
    need(
        body.get("encoding", "dcp") in _ENCODINGS,
        f"encoding {body.get('encoding')!r} is not one of {list(_ENCODINGS)}; written by a newer tierstore?",
    )
    if "metrics" in body:
        try:
            check_metrics(body["metrics"], source="metrics", error=ValueError)
        except ValueError as err:
            need(False, str(err))
    for key in ("run", "job"):
        if key in body:
            need(
                is_run_text(body[key]),
                f"{key} {_short(body[key])} is not 1 to {MAX_RUN} printable characters without "
                "'/' or a space at either end",
            )
    if "fingerprint" in body:
        need(
            isinstance(body["fingerprint"], str) and bool(_SHA256.fullmatch(body["fingerprint"])),
            f"fingerprint {_short(body['fingerprint'])} is not 'sha256:' and 64 lowercase hex digits",
        )


def _check_entry(entry: object, lo: int, hi: int, seen: set[str], need: Need) -> FileEntry:
    need(
        isinstance(entry, dict) and set(entry) == _FILE_KEYS,
        f"file entry {entry!r} must have exactly {sorted(_FILE_KEYS)}",
    )
    assert isinstance(entry, dict)
    try:
        check_relpath(entry["path"])
    except ValueError as err:
        need(False, str(err))
    need(entry["path"] not in seen, f"file {entry['path']!r} listed twice")
    seen.add(entry["path"])
    need(_is_int(entry["size"], 0, MAX_FILE_SIZE), f"file {entry['path']!r}: absurd size {entry['size']!r}")
    need(_is_int(entry["crc32c"], 0, _CRC_MAX), f"file {entry['path']!r}: bad crc32c {entry['crc32c']!r}")
    need(
        _is_int(entry["rank"], lo, hi),
        f"file {entry['path']!r}: rank {entry['rank']!r} outside "
        + (f"world size {hi + 1}" if lo == 0 else f"the part's ranks {lo}-{hi}"),
    )
    return FileEntry(**entry)


def _check_files(
    files: object, lo: int, hi: int, limit: int, need: Need, seen: set[str] | None = None
) -> tuple[FileEntry, ...]:
    need(isinstance(files, list) and 0 < len(files) <= limit, "files is not a non-empty list")
    assert isinstance(files, list)
    seen = set() if seen is None else seen
    return tuple(_check_entry(entry, lo, hi, seen, need) for entry in files)


def validate_flat(body: Mapping[str, Any], *, source: str, error: type[Exception]) -> tuple[FileEntry, ...]:
    """A version 1 body (without its checksum); its entries."""
    need = _needer(source, error)
    _check_version(body, FORMAT, need)
    _check_keys(body, _FLAT_KEYS, _OPTIONAL_KEYS, need)
    _check_header(body, need)
    seen: set[str] = set()
    files = _check_files(body["files"], 0, body["world_size"] - 1, MAX_FILES, need, seen)
    need(body["metadata_file"] in seen, f"metadata file {body['metadata_file']!r} is not listed")
    return files


def validate_root(
    body: Mapping[str, Any], *, source: str, error: type[Exception]
) -> tuple[FileEntry, tuple[PartRef, ...]]:
    """A version 2 root (without its checksum); its ``.metadata`` entry and part references."""
    need = _needer(source, error)
    _check_version(body, FORMAT, need)
    _check_keys(body, _ROOT_KEYS, _ROOT_OPTIONAL_KEYS, need)
    _check_header(body, need)
    world = body["world_size"]
    metadata = _check_entry(body["metadata"], 0, world - 1, set(), need)
    refs = body["parts"]
    need(
        isinstance(refs, list) and 0 < len(refs) <= MAX_PARTS,
        f"parts is not a list of 1 to {MAX_PARTS} parts",
    )
    parts = tuple(_check_ref(i, ref, world, need) for i, ref in enumerate(refs))
    for before, after in itertools.pairwise(parts):
        need(
            before.last_rank < after.first_rank,
            f"part {after.index}: rank ranges overlap or are not ascending",
        )
    count = sum(p.files for p in parts) + 1
    need(
        body["file_count"] == count and _is_int(count, 2, MAX_FILES * MAX_PARTS),
        f"file_count {body['file_count']!r} is not the parts' {count - 1} files plus the metadata",
    )
    need(
        _is_int(body["total_size"], metadata.size, MAX_FILE_SIZE * count),
        f"total_size {body['total_size']!r} is absurd",
    )
    return metadata, parts


def _check_ref(index: int, ref: object, world: int, need: Need) -> PartRef:
    need(
        isinstance(ref, dict) and set(ref) == _REF_KEYS,
        f"part {index} {ref!r} must have exactly {sorted(_REF_KEYS)}",
    )
    assert isinstance(ref, dict)
    need(
        ref["path"] == layout.manifest_part_path(index),
        f"part {index}: path {ref['path']!r} is not {layout.manifest_part_path(index)!r}",
    )
    need(
        _is_int(ref["first_rank"], 0, world - 1) and _is_int(ref["last_rank"], ref["first_rank"], world - 1),
        f"part {index}: ranks {ref['first_rank']!r}-{ref['last_rank']!r} outside world size {world}",
    )
    need(_is_int(ref["files"], 1, MAX_FILES), f"part {index}: bad file count {ref['files']!r}")
    need(_is_int(ref["size"], 2, MAX_PART_BYTES), f"part {index}: bad size {ref['size']!r}")
    need(
        isinstance(ref["sha256"], str) and bool(_SHA256.fullmatch(ref["sha256"])),
        f"part {index}: bad sha256 {ref['sha256']!r}",
    )
    return PartRef(index=index, **ref)


def validate_part(
    data: bytes, ref: PartRef, *, name: str, attempt: str, metadata_file: str, error: type[Exception]
) -> tuple[FileEntry, ...]:
    """Part ``ref`` of ``name``/``attempt``, read as ``data``; its entries.

    The root vouches for the bytes (sha256); the part's own name, attempt, index and rank
    range must still agree, so a forger cannot reuse one checkpoint's valid part in another.
    """
    need = _needer(f"manifest part {ref.index}", error)
    need(len(data) == ref.size, f"{len(data)} bytes, the root says {ref.size}")
    need(
        digest(data) == ref.sha256,
        f"sha256 differs from the root's {ref.sha256}; modified, corrupt or from another checkpoint",
    )
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise error(f"manifest part {ref.index}: not valid JSON ({err})") from err
    need(isinstance(body, dict), "top level is not an object")
    _check_version(body, PART_FORMAT, need)
    _check_keys(body, _PART_KEYS, set(), need)
    need(
        body["name"] == name and body["attempt"] == attempt and body["index"] == ref.index,
        f"names checkpoint {body['name']!r} attempt {body['attempt']!r} part {body['index']!r}, "
        f"not {name!r} attempt {attempt!r} part {ref.index}",
    )
    need(
        body["first_rank"] == ref.first_rank and body["last_rank"] == ref.last_rank,
        "rank range differs from the root's",
    )
    files = _check_files(body["files"], ref.first_rank, ref.last_rank, MAX_FILES, need)
    need(len(files) == ref.files, f"{len(files)} files, the root says {ref.files}")
    need(all(f.path != metadata_file for f in files), f"lists the metadata file {metadata_file!r}")
    return files


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
