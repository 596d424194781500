"""The strict reader of the manifest's three JSON forms (docs/format.md): a flat manifest
(version 1), a root and a part (version 2), each checked field by field against the schema
and the limits of :mod:`tierstore.format.manifest_format`, which writes them.

Each function raises ``error(f"{source}: ...")``, naming what is wrong: a manifest is hostile
input until it passes (docs/design.md invariants 4 and 6). No I/O here.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.format.manifest_format import (
    _CRC_MAX,
    _SHA256,
    FORMAT,
    MAX_FILE_SIZE,
    MAX_FILES,
    MAX_PART_BYTES,
    MAX_PARTS,
    MAX_RUN,
    MAX_STEP,
    MAX_WORLD_SIZE,
    PART_FORMAT,
    VERSION,
    FileEntry,
    Need,
    PartRef,
    _needer,
    _short,
    check_metrics,
    check_relpath,
    digest,
    is_run_text,
)

__all__ = ["validate_flat", "validate_part", "validate_root"]

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
