"""Where a node keeps the copies it holds for other nodes, and what says they are verified.

Each node's hot root has a replica namespace, ``replicas/`` (:data:`~tierstore.format.layout.REPLICA_DIR`),
laid out as a tier of its own (role ``"peer"``): ``replicas/checkpoints/<name>/<attempt>/...``
holds the other ranks' files this node keeps (and parity blocks under ``parity/``), and
``replicas/protection/<name>/<attempt>.json`` the record of the checkpoint's protection:
the scheme, the topology, which nodes verified which ranks' copies, and each parity
block's size and CRC32C. Last, ``replicas/manifests/<name>.json`` (the checkpoint's
manifest, published as a tier publishes one) is the commit of the protection: a
checkpoint is "protected" on a node only once that manifest is there, and it is published
only after every copy verified (:mod:`tierstore.redundancy.protect`). The hot roots of the
surviving nodes are then a catalog of their own: no cold tier needed to find or load it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tierstore.errors import ObjectNotFound, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.redundancy.schemes import Parity, Replicas, Scheme, Topology
from tierstore.storage import faults
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers.tier import Tier

__all__ = ["FileSink", "FileSource", "Record", "drop_copies", "peer_tier", "read_record", "write_record"]

RECORD_FORMAT = 1
_MAX_RECORD = 1 << 24


def peer_tier(hot: Tier) -> Tier:
    """The replica namespace of ``hot`` as a tier (sharing nothing with ``hot`` but the root)."""
    return Tier("peer", hot.url.rstrip("/") + "/" + layout.REPLICA_DIR, hot.options)


def record_key(name: str, attempt: str) -> str:
    return f"protection/{name}/{layout.check_attempt(attempt)}.json"


def parity_path(local: int, stripe: int) -> str:
    return f"parity/l{local}-s{stripe}.bin"


@dataclass(frozen=True)
class Record:
    """A checkpoint's protection as every node agreed on it."""

    name: str
    attempt: str
    scheme: Scheme
    topology: Topology
    holders: dict[int, list[int]]  # rank -> nodes holding a verified copy of its files
    parity: dict[str, tuple[int, int]]  # parity path@node -> (size, crc32c)

    @property
    def copies(self) -> int:
        """The copies protecting the checkpoint: the least of any rank's (for parity, the
        lost nodes per group it survives, plus one)."""
        if isinstance(self.scheme, Parity):
            return self.scheme.m + 1 if self.holders else 1
        return min((len(v) for v in self.holders.values()), default=1)

    def to_json(self) -> bytes:
        scheme: dict[str, Any] = (
            {"kind": "replicas", "copies": self.scheme.copies}
            if isinstance(self.scheme, Replicas)
            else {"kind": "parity", "k": self.scheme.k, "m": self.scheme.m}
        )
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "name": self.name,
                "attempt": self.attempt,
                "scheme": scheme,
                "world": self.topology.world,
                "local_world": self.topology.local_world,
                "placement": list(self.topology.placement) if self.topology.placement is not None else None,
                "holders": {str(r): nodes for r, nodes in sorted(self.holders.items())},
                "parity": {k: list(v) for k, v in sorted(self.parity.items())},
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, *, name: str, attempt: str) -> Record:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != RECORD_FORMAT:
            raise ValueError("not a protection record of format 1")
        if raw.get("name") != name or raw.get("attempt") != attempt:
            raise ValueError(f"the record names {raw.get('name')!r} attempt {raw.get('attempt')!r}")
        spec = raw["scheme"]
        scheme: Scheme = (
            Replicas(int(spec["copies"]))
            if spec["kind"] == "replicas"
            else Parity(int(spec["k"]), int(spec["m"]))
        )
        placement = raw.get("placement")
        topology = Topology(
            int(raw["world"]),
            int(raw["local_world"]),
            None if placement is None else tuple(int(n) for n in placement),
        )
        holders = {int(r): [int(n) for n in nodes] for r, nodes in raw["holders"].items()}
        parity = {str(k): (int(v[0]), int(v[1])) for k, v in raw["parity"].items()}
        return cls(name, attempt, scheme, topology, holders, parity)


def write_record(peers: Tier, record: Record) -> None:
    with peers.backend.open_write(record_key(record.name, record.attempt)) as out:
        out.write(record.to_json())


def read_record(peers: Tier, manifest: Manifest) -> Record | None:
    """The record of ``manifest``'s attempt on this node, ``None`` if absent or unreadable."""
    try:
        data = peers.backend.read_bytes(record_key(manifest.name, manifest.attempt), limit=_MAX_RECORD)
        return Record.from_json(data, name=manifest.name, attempt=manifest.attempt)
    except ObjectNotFound:
        return None
    except (TierstoreError, ValueError, KeyError, TypeError) as err:
        import logging

        logging.getLogger(__name__).warning(
            "ignoring the protection record of %s in %s: %s", manifest.name, peers.label, err
        )
        return None


class FileSource:
    """A file of an attempt in a tier (or ``length`` bytes of it from ``offset``), read sequentially."""

    def __init__(self, tier: Tier, key: str, offset: int | None = None, length: int = 0) -> None:
        backend = tier.backend
        self._stream = backend.open_read(key) if offset is None else backend.open_range(key, offset, length)

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(memoryview(buffer))])

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` from the file (fewer bytes only at its end): no copy in between."""
        got = 0
        readinto = getattr(self._stream, "readinto", None)
        while got < len(view):
            if readinto is not None:
                n = readinto(view[got:])
            else:
                part = self._stream.read(len(view) - got)
                n = len(part)
                view[got : got + n] = part
            if not n:
                break
            got += n
        return got

    def close(self) -> None:
        self._stream.close()


class FileSink:
    """Writes a received file to ``tier`` at ``key``, keeping it only if its size and CRC32C
    are the manifest's (``expect``); ``ok`` says which. A write that fails (a full disk) stops
    writing but goes on taking the bytes, so the transfer stays in step."""

    def __init__(self, tier: Tier, key: str, expect: FileEntry | tuple[int, int]) -> None:
        self.tier, self.key = tier, key
        self.size, self.crc = (expect.size, expect.crc32c) if isinstance(expect, FileEntry) else expect
        self.ok = False
        self.error: str | None = None
        self._got, self._crc = 0, 0
        self._out: Any = None
        self._opened = False

    def _open(self) -> None:
        self._opened = True
        try:
            self._out = self.tier.backend.open_write(self.key)
        except TierstoreError as err:
            self._out, self.error = None, str(err)

    def write(self, data: memoryview) -> None:
        if not self._opened:
            self._open()
        self._got += len(data)
        self._crc = crc32c_update(self._crc, data)
        if self._out is not None:
            try:
                self._out.write(data)
            except TierstoreError as err:
                self._out.abort()
                self._out, self.error = None, str(err)

    def close(self) -> None:
        if not self._opened:
            self._open()
        if self._out is None:
            return
        if self._got != self.size or self._crc != self.crc:
            self._out.abort()
            self.error = (
                f"arrived as {self._got} bytes of CRC32C {self._crc:08x}, the manifest says "
                f"{self.size} bytes of {self.crc:08x}"
            )
            return
        try:
            self._out.close()
            self.ok = True
        except TierstoreError as err:
            self.error = str(err)
        self._out = None


def drop_copies(peers: Tier, manifest: Manifest) -> int:
    """Delete this node's copies of ``manifest``'s attempt (retention pruned the checkpoint):
    the protection's manifest first, only while it is that attempt's (a name committed again
    since keeps its own), then the copies, the parity blocks and the record. The bytes freed."""
    here = peers.find_manifest(manifest.name)
    if here is not None:
        if here.attempt != manifest.attempt:
            return 0
        faults.point("peers.before_drop_unpublish")
        if not peers.unpublish(here):
            return 0
    faults.point("peers.before_drop_files")
    found = list(peers.backend.list(layout.attempt_prefix(manifest.name, manifest.attempt)))
    keys = [info.key for info in found]
    try:
        peers.backend.stat(record_key(manifest.name, manifest.attempt))
        keys.append(record_key(manifest.name, manifest.attempt))
    except ObjectNotFound:
        pass
    if keys:
        peers.backend.delete_many(keys)
    return sum(info.size for info in found)


def describe_copies(hot: Tier) -> list[dict[str, Any]]:
    """What ``hot``'s replica namespace says of each checkpoint it protects, newest last: the
    scheme, the least copies of any rank, and which nodes hold each rank's files (from the
    record; ``tierstore status``). Nothing is read but the namespace's manifests and records."""
    peers = peer_tier(hot)
    rows = []
    for manifest in sorted(
        peers.manifests(), key=lambda m: (m.step if m.step is not None else -1, m.created)
    ):
        record = read_record(peers, manifest)
        rows.append(
            {
                "name": manifest.name,
                "step": manifest.step,
                "attempt": manifest.attempt,
                "scheme": record.scheme.describe() if record else None,
                "copies": record.copies if record else None,
                "holders": {str(r): nodes for r, nodes in sorted(record.holders.items())} if record else {},
            }
        )
    return rows
