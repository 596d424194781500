"""The manifest: the one mark of a complete checkpoint in a tier (docs/design.md invariant 1).

Frozen data types, their versioned JSON form, strict validation and the manifest's own
checksum. No I/O here. A manifest names every file of one attempt with its size, CRC32C
and writing rank (invariant 4); readers trust nothing it does not vouch for.

``encoding`` says how the data files are laid out (:mod:`tierstore.commit.encoding`). It is
written only when it is not "dcp", the format of every checkpoint written before the field
existed, so a dcp-encoded checkpoint's manifest stays readable by older tierstore versions.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierstore.commit import layout
from tierstore.errors import ConfigError, InvalidManifest

__all__ = ["FORMAT", "VERSION", "Checkpoint", "FileEntry", "Manifest", "check_relpath",
           "checkpoint_order"]

FORMAT = "tierstore.manifest"
VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1_000_000
MAX_FILE_SIZE = 1 << 50  # 1 PiB: anything larger is a forged or corrupt entry
MAX_WORLD_SIZE = 1 << 20
_CRC_MAX = (1 << 32) - 1
_PATH = re.compile(r"[A-Za-z0-9_.-]{1,255}(/[A-Za-z0-9_.-]{1,255}){0,7}")
_KEYS = {"format", "version", "name", "step", "attempt", "world_size", "created",
         "producer", "metadata_file", "files", "checksum"}
_OPTIONAL_KEYS = {"encoding"}
_FILE_KEYS = {"path", "size", "crc32c", "rank"}
_ENCODINGS = ("dcp", "raw")  # tierstore.commit.encoding.ENCODINGS; "dcp" when absent


def check_relpath(path: object) -> str:
    """A file path inside a checkpoint: relative, no ``.``/``..``, tame characters."""
    if (
        not isinstance(path, str)
        or not _PATH.fullmatch(path)
        or any(part in (".", "..") for part in path.split("/"))
    ):
        raise ValueError(f"unsafe file path {path!r}: must be relative and stay inside the checkpoint")
    return path


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


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the attempt directory."""

    path: str
    size: int
    crc32c: int
    rank: int


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: what it is, and every file that makes it up."""

    name: str
    step: int | None
    attempt: str
    world_size: int
    created: float
    files: tuple[FileEntry, ...]
    metadata_file: str = layout.METADATA_FILE
    producer: str = ""
    version: int = VERSION
    encoding: str = "dcp"
    _by_path: Mapping[str, FileEntry] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_path", {f.path: f for f in self.files})

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry | None:
        return self._by_path.get(path)

    def files_of_rank(self, rank: int) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.rank == rank)

    # -- JSON --------------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "name": self.name,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "created": self.created,
            "producer": self.producer,
            "metadata_file": self.metadata_file,
            "files": [
                {"path": f.path, "size": f.size, "crc32c": f.crc32c, "rank": f.rank}
                for f in self.files
            ],
            **({} if self.encoding == "dcp" else {"encoding": self.encoding}),
        }

    def to_json(self) -> bytes:
        """Serialize, validated, with the manifest's own checksum appended."""
        body = self._body()
        _validate(body, source="new manifest", error=ConfigError)
        body["checksum"] = _checksum(body)
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, key: str | None = None, tier: str | None = None,
                  expect_name: str | None = None) -> Manifest:
        """Parse and strictly validate; :class:`InvalidManifest` names key and tier."""

        def bad(reason: str) -> InvalidManifest:
            return InvalidManifest(f"invalid manifest: {reason}", key=key, tier=tier,
                                   checkpoint=expect_name)

        if len(data) > MAX_MANIFEST_BYTES:
            raise bad(f"{len(data)} bytes is larger than the {MAX_MANIFEST_BYTES} byte limit")
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            # RecursionError: a forged manifest of thousands of nested brackets
            raise bad(f"not valid JSON ({err}); truncated or corrupt?") from err
        if not isinstance(body, dict):
            raise bad("top level is not an object")
        checksum = body.pop("checksum", None)
        try:
            _validate(body, source="manifest", error=ValueError)
        except ValueError as err:
            raise bad(str(err)) from err
        if checksum != _checksum(body):
            raise bad(f"self-checksum mismatch (recorded {checksum!r}); modified or corrupt")
        if expect_name is not None and body["name"] != expect_name:
            raise bad(f"names checkpoint {body['name']!r}, stored as {expect_name!r}")
        return cls(
            name=body["name"],
            step=body["step"],
            attempt=body["attempt"],
            world_size=body["world_size"],
            created=body["created"],
            files=tuple(FileEntry(**f) for f in body["files"]),
            metadata_file=body["metadata_file"],
            producer=body["producer"],
            version=body["version"],
            encoding=body.get("encoding", "dcp"),
        )


def _checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _is_int(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _validate(body: Mapping[str, Any], *, source: str, error: type[Exception]) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise error(f"{source}: {what}")

    need(body.get("format") == FORMAT, f"format is {body.get('format')!r}, not {FORMAT!r}")
    version = body.get("version")
    need(_is_int(version, 1, VERSION),
         f"version {version!r} is not supported (this tierstore reads up to {VERSION}); "
         "written by a newer tierstore?")
    keys = set(body) - _OPTIONAL_KEYS
    need(keys == _KEYS - {"checksum"},
         f"fields {sorted(keys ^ (_KEYS - {'checksum'}))} missing or unexpected")
    need(body.get("encoding", "dcp") in _ENCODINGS,
         f"encoding {body.get('encoding')!r} is not one of {list(_ENCODINGS)}; written by a "
         "newer tierstore?")
    try:
        layout.check_name(body["name"])
        layout.check_attempt(body["attempt"])
    except ConfigError as err:
        need(False, err.message)
    need(body["step"] is None or _is_int(body["step"], 0, 1 << 62), "step is not a non-negative int")
    need(_is_int(body["world_size"], 1, MAX_WORLD_SIZE), "world_size is not a positive int")
    created = body["created"]
    need(isinstance(created, (int, float)) and not isinstance(created, bool)
         and math.isfinite(created) and created >= 0, "created is not a timestamp")
    need(isinstance(body["producer"], str) and len(body["producer"]) < 1024, "producer is not a short string")
    files = body["files"]
    need(isinstance(files, list) and 0 < len(files) <= MAX_FILES, "files is not a non-empty list")
    seen: set[str] = set()
    for entry in files:
        need(isinstance(entry, dict) and set(entry) == _FILE_KEYS,
             f"file entry {entry!r} must have exactly {sorted(_FILE_KEYS)}")
        try:
            check_relpath(entry["path"])
        except ValueError as err:
            need(False, str(err))
        need(entry["path"] not in seen, f"file {entry['path']!r} listed twice")
        seen.add(entry["path"])
        need(_is_int(entry["size"], 0, MAX_FILE_SIZE),
             f"file {entry['path']!r}: absurd size {entry['size']!r}")
        need(_is_int(entry["crc32c"], 0, _CRC_MAX), f"file {entry['path']!r}: bad crc32c {entry['crc32c']!r}")
        need(_is_int(entry["rank"], 0, body["world_size"] - 1),
             f"file {entry['path']!r}: rank {entry['rank']!r} outside world size {body['world_size']}")
    need(body["metadata_file"] in seen, f"metadata file {body['metadata_file']!r} is not listed")

