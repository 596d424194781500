"""Every key and file name in a store. Nothing else builds paths.

A store root (one per tier) looks like::

    manifests/<name>.json                       the commit mark of checkpoint <name>
    checkpoints/<name>/<attempt>/.metadata      DCP's metadata, written by the coordinator
    checkpoints/<name>/<attempt>/__<rank>_<n>.distcp   shard files, one set per rank
    checkpoints/<name>/<attempt>/r<k>/__<rank>_<n>.distcp   the same, spread by rank when one
                                                directory would hold too many (see below)
    checkpoints/<name>/<attempt>/.manifest-part-<i>.json   part <i> of a two-level manifest
    uploads/<name>/<attempt>/rank-<rank>/<digest>.<versions>.json   per-rank upload marks
                                                (cold tier only), named by a digest of the files
                                                they vouch for and one of the stored objects'
                                                versions the rank verified (tiers.marks); just
                                                <digest>.json where the backend has no versions
    uploads/<name>/<attempt>/rank-<rank>.json   the same, as earlier versions named them
    uploads/<name>/<attempt>/rank-<rank>.failed.json   a rank's failed upload (cold tier only)
    leases/<name>/<lease>.json                  "in use by a load" marks
    runs/<run>/<beat>.json                      hot tier: "a job is saving here" (run locks,
                                                tierstore.tiers.runlock; gc leaves them)
    migrated/<name>/<attempt>/<store-id>.json   hot tier: "committed in the cold tier whose
                                                identity is <store-id>" (survives a cold prune)
    quarantine/<name>/<attempt>.json            a checkpoint a verified load proved damaged,
                                                un-published; its record keeps its manifest,
                                                and its data stays until removed by hand
                                                (tierstore.lifecycle.quarantine)
    tierstore-store.json                        cold tier: the tier's identity, written once

On object stores (backends with ``spread_keys``) data files live under
``shards/<xx>/<name>/<attempt>/<file>`` instead, ``<xx>`` two hex digits of a hash: thousands
of ranks uploading at once then spread over 256 key prefixes rather than hammering one, which
is what triggers S3's per-prefix throttling (503 SlowDown). For an attempt id ending in ``-g``
(every raw-encoded save) the hash is of the name, attempt and rank group (64 ranks), so the
attempt's files sit under at most W/64 + 1 prefixes and the cold commit checks them with as
many listings; other attempts (dcp-encoded) hash each file's whole path.

A save whose attempt directory would hold more than ``max_files_per_dir`` files puts each
rank's shards in ``r<k>/``, ``k = rank // ranks_per_dir`` (zero-padded; ``ranks_per_dir`` a
power of ten, so ``r012/`` holds ranks 12000-12999 at 1,000 per directory): filesystems slow
down on directories of hundreds of thousands of entries. The manifest records the relative
path as always, so nothing that reads a checkpoint needs to know.

Parts of a two-level manifest (:mod:`tierstore.format.manifest_format`) live with the
attempt's files, so they are data of the attempt to gc and prune: kept while the attempt's
manifest names them, deleted with it.

``<attempt>`` is unique to one save attempt (docs/design.md invariant 3), so a rerun of a step
never touches a committed attempt's files. An attempt directory is a plain DCP checkpoint:
``FileSystemReader`` can read it directly, tierstore not needed.

Why one module of about 460 lines: nothing else builds paths, so every key of a store, its
parser and the tree above are here together.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from enum import Enum

from tierstore.errors import ConfigError

__all__ = [
    "MANIFEST_DIR",
    "DATA_DIR",
    "UPLOAD_DIR",
    "METADATA_FILE",
    "REPLICA_DIR",
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
    "ranks_per_dir",
    "manifest_part_path",
    "is_manifest_part",
    "upload_mark_key",
    "failed_mark_key",
    "parse_upload_key",
    "upload_mark_digest",
    "upload_mark_versions",
    "rank_marks_prefix",
    "upload_prefix",
    "migrated_key",
    "migrated_prefix",
    "parse_migrated_key",
    "quarantine_key",
    "quarantine_prefix",
    "parse_quarantine_key",
    "KeyKind",
    "kind_of",
    "is_temporary",
    "run_lock_key",
    "run_lock_prefix",
    "STORE_ID_KEY",
    "new_store_id",
    "check_store_id",
]

MANIFEST_DIR = "manifests"
DATA_DIR = "checkpoints"
SPREAD_DIR = "shards"
UPLOAD_DIR = "uploads"
LEASE_DIR = "leases"
RUN_DIR = "runs"
MIGRATED_DIR = "migrated"
QUARANTINE_DIR = "quarantine"
REPLICA_DIR = "replicas"  # a node-local hot root's copies of other nodes' files (tierstore.redundancy)
STORE_ID_KEY = "tierstore-store.json"
METADATA_FILE = ".metadata"  # DCP's own name, so an attempt directory is plain DCP
MANIFEST_SUFFIX = ".json"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ATTEMPT = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}(-g)?")
_GROUPED = "-g"  # the attempt's files are spread by rank group: see file_key
RANKS_PER_PREFIX = 64
_RANK_FILE = re.compile(r"(?:^|/)__(0|[1-9][0-9]{0,8})_")
_STORE_ID = re.compile(r"[0-9a-f]{32}")
_UPLOAD_MARK = re.compile(r"rank-(0|[1-9][0-9]{0,8})(\.failed)?\.json")
_MARK_DIGEST = re.compile(r"([0-9a-f]{16})(?:\.([0-9a-f]{16}))?\.json")
_RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]{0,8})")


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


def new_attempt(now: float | None = None, *, grouped: bool = False) -> str:
    """A fresh attempt id: UTC time (for humans and GC) plus 32 random bits, and ``-g`` when
    its files spread over key prefixes by rank group (:func:`file_key`)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{uuid.uuid4().hex[:8]}{_GROUPED if grouped else ''}"


def check_attempt(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.fullmatch(attempt):
        raise ConfigError(f"invalid attempt id {attempt!r}")
    return attempt


def manifests_prefix() -> str:
    """Where a tier's manifests are listed from."""
    return MANIFEST_DIR + "/"


def manifest_key(name: str) -> str:
    return f"{MANIFEST_DIR}/{check_name(name)}{MANIFEST_SUFFIX}"


def parse_manifest_key(key: str) -> str | None:
    """The checkpoint name a manifest key stands for, or ``None`` for any other key."""
    prefix = manifests_prefix()
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
    hashed = rest
    if attempt.endswith(_GROUPED):
        # One prefix per group of RANKS_PER_PREFIX ranks (and one for the rest: .metadata,
        # manifest parts): an attempt of W ranks uses at most W/64 + 1 prefixes, so one
        # listing per prefix checks it in W/64 requests, while thousands of ranks uploading
        # at once still spread over up to 256 prefixes.
        rank = _RANK_FILE.search(relpath)
        group = str(int(rank.group(1)) // RANKS_PER_PREFIX) if rank else "-"
        hashed = f"{name}/{attempt}/{group}"
    return f"{SPREAD_DIR}/{hashlib.sha1(hashed.encode()).hexdigest()[:2]}/{rest}"


def attempt_prefixes(name: str, attempt: str, world_size: int, *, spread: bool) -> list[str] | None:
    """Every prefix an attempt's files (data, ``.metadata``, manifest parts) live under, so
    that listing them finds the whole attempt without reading its manifest's parts: the
    attempt's directory, or on an object store the hashed prefix of each rank group of a
    grouped attempt. ``None`` where the files could be under any of 256 hashed prefixes (an
    attempt from before grouping): only its manifest says where."""
    if not spread:
        return [attempt_prefix(name, attempt)]
    if not attempt.endswith(_GROUPED):
        return None
    groups = -(-world_size // RANKS_PER_PREFIX)
    paths = [data_file_name(g * RANKS_PER_PREFIX, 0) for g in range(groups)] + [METADATA_FILE]
    return sorted({file_key(name, attempt, p, spread=True).removesuffix(p) for p in paths})


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


def data_file_name(rank: int, index: int, ranks_per_dir: int = 0) -> str:
    """A shard's path in its attempt; under ``r<k>/`` when ``ranks_per_dir`` is set."""
    name = f"__{rank}_{index}.distcp"
    return f"r{rank // ranks_per_dir:03d}/{name}" if ranks_per_dir else name


def ranks_per_dir(files_per_rank: int, ranks: int, max_files_per_dir: int) -> int:
    """Ranks per ``r<k>/`` directory (a power of ten), or 0 when one directory holds them all."""
    if files_per_rank * ranks <= max_files_per_dir:
        return 0
    per_dir = 1
    while per_dir * 10 * files_per_rank <= max_files_per_dir:
        per_dir *= 10
    return per_dir


_PART_PATH = re.compile(r"\.manifest-part-[0-9]{5,}\.json")


def manifest_part_path(index: int) -> str:
    """Path, in its attempt, of part ``index`` of a two-level manifest."""
    return f".manifest-part-{index:05d}.json"


def is_manifest_part(path: str) -> bool:
    return bool(_PART_PATH.fullmatch(path.rsplit("/", 1)[-1]))


def upload_prefix(name: str, attempt: str) -> str:
    return f"{UPLOAD_DIR}/{check_name(name)}/{check_attempt(attempt)}/"


def upload_mark_key(
    name: str, attempt: str, rank: int, digest: str | None = None, versions: str | None = None
) -> str:
    """Rank ``rank``'s upload mark named by ``digest`` (16 hex digits naming the files it
    vouches for) and ``versions`` (16 hex digits naming the stored objects' versions it
    verified, where the backend has versions); without a digest, the key earlier versions
    used."""
    if digest is None:
        return f"{upload_prefix(name, attempt)}rank-{rank}.json"
    leaf = f"{digest}.json" if versions is None else f"{digest}.{versions}.json"
    if not _MARK_DIGEST.fullmatch(leaf):
        raise ConfigError(f"invalid upload mark digest {digest!r} / versions {versions!r}")
    return f"{upload_prefix(name, attempt)}rank-{rank}/{leaf}"


def rank_marks_prefix(name: str, attempt: str, rank: int) -> str:
    """Where rank ``rank``'s upload marks (named by their digests) live."""
    return f"{upload_prefix(name, attempt)}rank-{rank}/"


def upload_mark_digest(key: str) -> str | None:
    """The files digest an upload mark's key names, ``None`` for any other key."""
    return _mark_leaf(key)[0]


def upload_mark_versions(key: str) -> str | None:
    """The versions digest an upload mark's key names, ``None`` if it names none."""
    return _mark_leaf(key)[1]


def _mark_leaf(key: str) -> tuple[str | None, str | None]:
    parts = key.split("/")
    match = _MARK_DIGEST.fullmatch(parts[-1])
    if len(parts) != 5 or match is None or parse_upload_key(key) is None:
        return None, None
    return match.group(1), match.group(2)


def failed_mark_key(name: str, attempt: str, rank: int) -> str:
    return f"{upload_prefix(name, attempt)}rank-{rank}.failed.json"


def parse_upload_key(key: str) -> tuple[str, str, int, bool] | None:
    """``(name, attempt, rank, failed)`` of an upload or failure mark key, else ``None``."""
    parts = key.split("/")
    if len(parts) == 5 and _MARK_DIGEST.fullmatch(parts[4]):  # a mark named by its digest
        parts, named = parts[:4], _RANK_DIR.fullmatch(parts[3])
        if named is None:
            return None
        parts[3] = f"{named.group(0)}.json"
    if len(parts) != 4 or parts[0] != UPLOAD_DIR:
        return None
    match = _UPLOAD_MARK.fullmatch(parts[3])
    if not (match and _NAME.fullmatch(parts[1]) and _ATTEMPT.fullmatch(parts[2])):
        return None
    return parts[1], parts[2], int(match.group(1)), match.group(2) is not None


def lease_prefix(name: str) -> str:
    return f"{LEASE_DIR}/{check_name(name)}/"


def lease_key(name: str, lease: str) -> str:
    return f"{lease_prefix(name)}{lease}.json"


def run_lock_prefix(run: str | None = None) -> str:
    """``runs/``, or the prefix of one run's heartbeats."""
    if run is None:
        return RUN_DIR + "/"
    if not isinstance(run, str) or not _STORE_ID.fullmatch(run):
        raise ConfigError(f"invalid run id {run!r}")
    return f"{RUN_DIR}/{run}/"


def run_lock_key(run: str, beat: int) -> str:
    """Heartbeat ``beat`` of the job whose run id is ``run`` (32 hex digits, as a store id):
    a new object per beat, since ``publish`` never replaces one."""
    return f"{run_lock_prefix(run)}{beat:010d}.json"


def clock_probe_key(token: str) -> str:
    """A short-lived object whose store-assigned mtime reads the store's clock (see leases).

    One level under ``leases/``, so never inside a checkpoint's lease prefix."""
    return f"{LEASE_DIR}/clock-{token}.probe"


def new_store_id() -> str:
    return uuid.uuid4().hex


def check_store_id(store_id: str) -> str:
    if not isinstance(store_id, str) or not _STORE_ID.fullmatch(store_id):
        raise ConfigError(f"invalid store id {store_id!r}")
    return store_id


def migrated_prefix(name: str, attempt: str) -> str:
    """Where the migrated marks of one attempt live, whichever cold tier they name."""
    return f"{MIGRATED_DIR}/{check_name(name)}/{check_attempt(attempt)}/"


def migrated_key(name: str, attempt: str, store_id: str) -> str:
    """Hot-tier mark: the attempt was committed in the cold tier ``store_id``, even if that
    tier pruned it since."""
    return f"{migrated_prefix(name, attempt)}{check_store_id(store_id)}.json"


def parse_migrated_key(key: str) -> tuple[str, str, str | None] | None:
    """``(name, attempt, store_id)`` of a migrated mark; ``store_id`` is ``None`` for the
    keys without one, which no release writes (gc removes them)."""
    parts = key.split("/")
    if parts[0] != MIGRATED_DIR or not parts[-1].endswith(".json"):
        return None
    if len(parts) == 3:
        name, attempt, store_id = parts[1], parts[2].removesuffix(".json"), None
    elif len(parts) == 4:
        name, attempt, store_id = parts[1], parts[2], parts[3].removesuffix(".json")
        if not _STORE_ID.fullmatch(store_id):
            return None
    else:
        return None
    if _NAME.fullmatch(name) and _ATTEMPT.fullmatch(attempt):
        return name, attempt, store_id
    return None


def quarantine_prefix(name: str | None = None) -> str:
    """Where the quarantine records live (of ``name``, if given)."""
    return f"{QUARANTINE_DIR}/" if name is None else f"{QUARANTINE_DIR}/{check_name(name)}/"


def quarantine_key(name: str, attempt: str) -> str:
    return f"{quarantine_prefix(name)}{check_attempt(attempt)}{MANIFEST_SUFFIX}"


def parse_quarantine_key(key: str) -> tuple[str, str] | None:
    """``(name, attempt)`` of a quarantine record's key, else ``None``."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != QUARANTINE_DIR or not parts[2].endswith(MANIFEST_SUFFIX):
        return None
    attempt = parts[2][: -len(MANIFEST_SUFFIX)]
    if _NAME.fullmatch(parts[1]) and _ATTEMPT.fullmatch(attempt):
        return parts[1], attempt
    return None


class KeyKind(str, Enum):
    """What a key in a store root is, by where it lives (see the module docstring)."""

    DATA = "data"  # a file of an attempt, in either layout (publish temporaries included)
    MANIFEST = "manifest"
    STORE_ID = "store-id"
    TEMPORARY = "temporary"  # a publish's temporary outside any attempt's data
    UPLOAD_MARK = "upload-mark"  # under uploads/: a mark, or damage where a mark would be
    MIGRATED_MARK = "migrated-mark"
    LEASE = "lease"
    CLOCK_PROBE = "clock-probe"
    QUARANTINE = "quarantine"  # a quarantine record (never garbage: removed by hand)
    REPLICA = "replica"  # under replicas/: the copies a node keeps for others (their own lifecycle)
    OTHER = "other"  # not a key tierstore writes


def is_temporary(key: str) -> bool:
    """A backend's publish temporary (``.<name>.tmp-<hex>``), left behind if the publish died."""
    return ".tmp-" in key.rsplit("/", 1)[-1]


def kind_of(key: str) -> KeyKind:
    """Classify ``key``; the order matters: a temporary inside an attempt's data is data (it
    goes with its attempt), the identity object is never a temporary or a mark."""
    if spread_attempt_of(key) is not None:
        return KeyKind.DATA
    if key == STORE_ID_KEY:
        return KeyKind.STORE_ID
    if is_temporary(key):
        return KeyKind.TEMPORARY
    top, sep, rest = key.partition("/")
    if not sep:
        return KeyKind.OTHER
    if top == UPLOAD_DIR:
        return KeyKind.UPLOAD_MARK
    if top == MIGRATED_DIR:
        return KeyKind.MIGRATED_MARK
    if top == QUARANTINE_DIR:
        return KeyKind.QUARANTINE
    if top == REPLICA_DIR:
        return KeyKind.REPLICA
    if top == LEASE_DIR:
        # One level under leases/: not in any checkpoint's lease prefix (clock_probe_key).
        return KeyKind.LEASE if "/" in rest else KeyKind.CLOCK_PROBE
    if parse_manifest_key(key) is not None:
        return KeyKind.MANIFEST
    return KeyKind.OTHER
