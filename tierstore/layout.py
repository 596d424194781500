"""Every key and file name in a store. Nothing else builds paths.

A store root (one per tier) looks like::

    manifests/<name>.json                       the commit mark of checkpoint <name>
    checkpoints/<name>/<attempt>/.metadata      DCP's metadata, written by the coordinator
    checkpoints/<name>/<attempt>/__<rank>_<n>.distcp   shard files, one set per rank
    uploads/<name>/<attempt>/rank-<rank>.json   per-rank upload marks (cold tier only)
    leases/<name>/<lease>.json                  "in use by a load" marks, with an expiry
    migrated/<name>/<attempt>.json              hot tier: "committed in cold" (survives a cold prune)

On object stores (backends with ``spread_keys``) data files live under
``shards/<xx>/<name>/<attempt>/<file>`` instead, ``<xx>`` two hex digits of a hash of the
rest: thousands of ranks uploading at once then spread over 256 key prefixes rather than
hammering one, which is what triggers S3's per-prefix throttling (503 SlowDown).

``<attempt>`` is unique to one save attempt (DESIGN.md invariant 3), so a rerun of a step
never touches a committed attempt's files. An attempt directory is a plain DCP checkpoint:
``FileSystemReader`` can read it directly, tierstore not needed.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid

from tierstore.errors import ConfigError

__all__ = [
    "MANIFEST_DIR",
    "DATA_DIR",
    "UPLOAD_DIR",
    "METADATA_FILE",
    "default_name",
    "check_name",
    "is_name",
    "new_attempt",
    "check_attempt",
    "manifest_key",
    "parse_manifest_key",
    "attempt_prefix",
    "checkpoint_prefix",
    "file_key",
    "spread_attempt_of",
    "data_file_name",
    "upload_mark_key",
    "upload_prefix",
]

MANIFEST_DIR = "manifests"
DATA_DIR = "checkpoints"
SPREAD_DIR = "shards"
UPLOAD_DIR = "uploads"
LEASE_DIR = "leases"
MIGRATED_DIR = "migrated"
METADATA_FILE = ".metadata"  # DCP's own name, so an attempt directory is plain DCP
MANIFEST_SUFFIX = ".json"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ATTEMPT = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")


def default_name(step: int) -> str:
    """``step-0000001200``: zero-padded so names sort like steps."""
    return f"step-{step:010d}"


def check_name(name: str) -> str:
    """A checkpoint name: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith(".tmp"):
        raise ConfigError(
            f"invalid checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (a checkpoint_id names a checkpoint inside the "
            "store, it is not a path)"
        )
    return name


def is_name(value: str | os.PathLike[str]) -> bool:
    """Whether ``value`` (a DCP ``checkpoint_id``, say) is a valid checkpoint name."""
    try:
        check_name(os.fspath(value))
    except (ConfigError, TypeError):
        return False
    return True


def new_attempt(now: float | None = None) -> str:
    """A fresh attempt id: UTC time (for humans and GC) plus 32 random bits."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{uuid.uuid4().hex[:8]}"


def check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.fullmatch(attempt):
        raise ConfigError(f"invalid attempt id {attempt!r}")
    return attempt


def manifest_key(name: str) -> str:
    return f"{MANIFEST_DIR}/{check_name(name)}{MANIFEST_SUFFIX}"


def parse_manifest_key(key: str) -> str | None:
    """The checkpoint name a manifest key stands for, or ``None`` for any other key."""
    prefix = MANIFEST_DIR + "/"
    if not (key.startswith(prefix) and key.endswith(MANIFEST_SUFFIX)):
        return None
    name = key[len(prefix) : -len(MANIFEST_SUFFIX)]
    return name if _NAME.fullmatch(name) else None


def checkpoint_prefix(name: str) -> str:
    return f"{DATA_DIR}/{check_name(name)}/"


def attempt_prefix(name: str, attempt: str) -> str:
    return f"{checkpoint_prefix(name)}{check_attempt(attempt)}/"


def file_key(name: str, attempt: str, relpath: str, *, spread: bool = False) -> str:
    """Key of a file named ``relpath`` in a manifest (validated there)."""
    if not spread:
        return attempt_prefix(name, attempt) + relpath
    rest = f"{check_name(name)}/{check_attempt(attempt)}/{relpath}"
    return f"{SPREAD_DIR}/{hashlib.sha1(rest.encode()).hexdigest()[:2]}/{rest}"


def spread_attempt_of(key: str) -> tuple[str, str] | None:
    """``(name, attempt)`` of a data key in either layout, ``None`` for other keys."""
    parts = key.split("/")
    if parts[0] == DATA_DIR and len(parts) >= 4:
        name, attempt = parts[1], parts[2]
    elif parts[0] == SPREAD_DIR and len(parts) >= 5:
        name, attempt = parts[2], parts[3]
    else:
        return None
    if _NAME.fullmatch(name) and _ATTEMPT.fullmatch(attempt):
        return name, attempt
    return None


def data_file_name(rank: int, index: int) -> str:
    return f"__{rank}_{index}.distcp"


def upload_prefix(name: str, attempt: str) -> str:
    return f"{UPLOAD_DIR}/{check_name(name)}/{check_attempt(attempt)}/"


def upload_mark_key(name: str, attempt: str, rank: int) -> str:
    return f"{upload_prefix(name, attempt)}rank-{rank}.json"


def lease_prefix(name: str) -> str:
    return f"{LEASE_DIR}/{check_name(name)}/"


def lease_key(name: str, lease: str) -> str:
    return f"{lease_prefix(name)}{lease}.json"


def migrated_key(name: str, attempt: str) -> str:
    """Hot-tier mark that the attempt was committed in cold, even if cold pruned it since."""
    return f"{MIGRATED_DIR}/{check_name(name)}/{check_attempt(attempt)}.json"
