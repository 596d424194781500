"""A tier (a backend in a role) and a store (the tiers of one checkpoint directory).

A :class:`Store` is the one value every store-wide call takes, as fsspec calls take an
``fs``: build it once from URLs and options, and pass it to :func:`~tierstore.list_checkpoints`,
:func:`~tierstore.prune`, :class:`~tierstore.TieredWriter` and the rest; an operation also takes
a URL, a store of that one tier. The three constructors (``TieredWriter``,
``TieredReader``, ``CheckpointManager``) also take the tiers' URLs, ``hot`` and ``cold``, and
build the store with :meth:`Store.of`; tier options and ``node_local`` are the store's only.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tierstore import errors
from tierstore._redact import redact_url
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.format.manifest import MAX_MANIFEST_BYTES, Manifest, PartRef
from tierstore.storage.backend import Backend, ObjectInfo
from tierstore.storage.missing import proven_missing
from tierstore.storage.registry import backend_class, open_backend, split_scheme

__all__ = ["Tier", "Store", "TierURL"]

log = logging.getLogger(__name__)

TierURL = str | os.PathLike[str]
_Cached = tuple[bytes, tuple[Any, ...] | None, Manifest]  # root digest, listing identity, value


class Tier:
    """A backend in a role (``"hot"`` or ``"cold"``), built lazily and never pickled.

    A tier keeps the manifests it has parsed, parts read included: a published manifest
    never changes (docs/design.md invariant 3), so a root listed with the same size, mtime
    (and CRC32C where the backend lists one) as before, or read back byte for byte the same,
    is the same manifest and is not read or parsed again. A name deleted and committed again
    gets a new root, which differs in those; a backend whose listing times are as coarse as
    a second (S3) could in principle list a re-commit of the same size within the same second
    as unchanged, which is why :meth:`find_manifest`, what a load resolves with, always reads
    the root.
    """

    def __init__(self, role: str, url: TierURL, options: Mapping[str, Any] | None = None) -> None:
        self.role = role
        self.url = os.fspath(url)
        split_scheme(self.url)  # a mistyped URL (``s3:/b/r``) is refused now, not used as a path
        self.options = dict(options or {})
        self._backend: Backend | None = None
        self._manifests: dict[str, _Cached] = {}
        self.store_id: str | None = None
        """The identity of the store in this tier, once this process has read it
        (:func:`tierstore.tiers.marks.store_id`); ``None`` means not read yet, never "none"."""

    def __repr__(self) -> str:
        return f"Tier({self.role!r}, {redact_url(self.url)!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_backend": None, "_manifests": {}}

    @property
    def label(self) -> str:
        return f"{self.role} {redact_url(self.url)}"

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = open_backend(self.url, self.options, label=self.role)
        return self._backend

    def check_scheme(self) -> None:
        """Raise :class:`~tierstore.errors.BackendNotFound` now if no backend serves this URL.

        Imports the plugin but builds no backend: nothing is sent to the tier, so a cold
        tier that is down cannot make this block.
        """
        backend_class(split_scheme(self.url)[0])

    def file_key(self, name: str, attempt: str, path: str) -> str:
        """Where this tier keeps file ``path`` of an attempt."""
        return layout.file_key(name, attempt, path, spread=self.backend.spread_keys)

    def find_manifest(self, name: str) -> Manifest | None:
        """The valid manifest of ``name``, ``None`` if absent; :class:`~tierstore.errors.InvalidManifest`
        if present but invalid (torn, corrupt, oversized). The one way to find a manifest in
        a tier.

        Reads the root only (one object, whatever the world size); parts are read when an
        entry of theirs is first asked for.
        """
        key = layout.manifest_key(name)
        try:
            data = self.backend.read_bytes(key, limit=MAX_MANIFEST_BYTES)
        except errors.ObjectNotFound:
            self._manifests.pop(key, None)
            return None
        except errors.ObjectTooLarge as err:
            raise errors.InvalidManifest(
                f"invalid manifest: {err.message}", key=err.key, tier=self.label, checkpoint=name
            ) from err
        return self._parse(key, name, data, None)

    def _parse(self, key: str, name: str, data: bytes, listed: tuple[Any, ...] | None) -> Manifest:
        digest = hashlib.sha256(data).digest()
        cached = self._manifests.get(key)
        if cached is not None and cached[0] == digest:
            manifest = cached[2]
        else:
            manifest = Manifest.from_json(
                data, key=key, tier=self.label, expect_name=name, loader=self.read_part
            )
        self._manifests[key] = (digest, listed, manifest)
        return manifest

    def holds(self, manifest: Manifest) -> bool:
        """Whether this tier's committed manifest of ``manifest.name`` is that attempt (read
        now: a prune may have removed it, or another attempt committed the name since)."""
        here = self.find_manifest(manifest.name)
        return here is not None and here.attempt == manifest.attempt

    def read_part(self, name: str, attempt: str, ref: PartRef) -> tuple[str, bytes]:
        """Part ``ref`` of a two-level manifest of ``name`` attempt ``attempt``: the key it
        was read from and its bytes (the loader of every manifest this tier reads)."""
        key = self.file_key(name, attempt, ref.path)
        try:
            return key, self.backend.read_bytes(key, limit=ref.size)
        except errors.ObjectNotFound as err:
            failed: errors.StorageError = err
        except errors.ObjectTooLarge as err:
            failed = err
        # One 404 is no proof (issue 34): a part the tier still lists is read again.
        if isinstance(failed, errors.ObjectNotFound) and not proven_missing(self.backend, key):
            try:
                return key, self.backend.read_bytes(key, limit=ref.size)
            except errors.ObjectNotFound as err:
                raise errors.TransientStorageError(
                    f"manifest part {ref.index} answered 404 twice but is listed: not damage",
                    key=key,
                    tier=self.label,
                    checkpoint=name,
                ) from err
        raise errors.InvalidManifest(
            f"invalid manifest: part {ref.index} is missing or larger "
            f"than the root's {ref.size} bytes ({failed.message})",
            key=key,
            tier=self.label,
            checkpoint=name,
        ) from failed

    def manifests(self) -> list[Manifest]:
        """Every valid manifest; invalid ones do not count as checkpoints and are logged."""
        found, invalid = self.scan_manifests()
        for err in invalid:
            log.warning("ignoring checkpoint with an invalid manifest: %s", err)
        return found

    def scan_manifests(self) -> tuple[list[Manifest], list[errors.InvalidManifest]]:
        """Valid manifests, and the errors of invalid ones (torn, corrupt, oversized).

        One listing, then one read per root that is new or changed since this tier last
        listed it; no part is read. Other storage errors propagate: a manifest that could
        not be read is not known to be damaged, and callers such as GC must not act as if
        it were absent.
        """
        found, invalid, listed = [], [], set()
        for info in self.backend.list(layout.manifests_prefix()):
            name = layout.parse_manifest_key(info.key)
            if name is None:
                continue
            listed.add(info.key)
            try:
                manifest = self._scanned(info, name)
            except errors.InvalidManifest as err:
                invalid.append(err)
                continue
            if manifest is not None:
                found.append(manifest)
        for gone in set(self._manifests) - listed:
            self._manifests.pop(gone, None)
        return found, invalid

    def _scanned(self, info: ObjectInfo, name: str) -> Manifest | None:
        ident = (info.size, info.mtime, info.crc32c, info.version)
        cached = self._manifests.get(info.key)
        if cached is not None and info.mtime is not None and cached[1] == ident:
            return cached[2]
        try:
            data = self.backend.read_bytes(info.key, limit=MAX_MANIFEST_BYTES)
        except errors.ObjectNotFound:
            return None  # deleted since the listing
        except errors.ObjectTooLarge as err:
            raise errors.InvalidManifest(
                f"invalid manifest: {err.message}", key=err.key, tier=self.label, checkpoint=name
            ) from err
        return self._parse(info.key, name, data, ident)

    def unpublish(self, manifest: Manifest) -> bool:
        """Delete ``manifest``'s root from this tier (the first step of a prune), but only
        while the root is still that manifest: ``False``, and nothing deleted, if the name
        was committed again since (another attempt, or the same one re-published by a
        restore). A decision made about one commit never deletes another (docs/design.md
        invariant 14).

        The version compared is the one this tier listed the root with (or one ``stat``,
        then a read checking the bytes are still this manifest); the backend's conditional
        delete does the rest (:meth:`~tierstore.storage.backend.Backend.delete_if`).
        """
        key = layout.manifest_key(manifest.name)
        cached = self._manifests.get(key)
        version = cached[1][3] if cached and cached[1] and cached[2] is manifest else None
        if version is None:
            try:
                version = self.backend.stat(key).version
                current = self.find_manifest(manifest.name)
            except errors.ObjectNotFound:
                return True
            if current != manifest:
                return current is None
            if version is None:  # a backend without versions: compared, then deleted
                self.backend.delete(key)
                self._manifests.pop(key, None)
                return True
        gone = self.backend.delete_if(key, version)
        if gone:
            self._manifests.pop(key, None)
        return gone

    def publish_manifest(self, manifest: Manifest) -> None:
        """The commit point of ``manifest`` in this tier; never overwrites.

        A two-level manifest's parts are written first, durably, with the attempt's files;
        the root's exclusive publish is the commit (docs/design.md invariant 2). Parts are
        rewritten with the same bytes when a commit is retried, so no reader ever sees one
        change.
        """
        keys = []
        for ref in manifest.parts:
            key = self.file_key(manifest.name, manifest.attempt, ref.path)
            with self.backend.open_write(key, defer_dir_sync=True) as out:
                out.write(manifest.part_json(ref))
            keys.append(key)
        self.backend.sync_dirs(keys)
        key = layout.manifest_key(manifest.name)
        data = manifest.to_json()
        try:
            self.backend.publish(key, data)
        except errors.PublishConflict as err:
            raise errors.CheckpointExists(
                "checkpoint is already committed (by another attempt); committed "
                "checkpoints are never overwritten",
                checkpoint=manifest.name,
                tier=self.label,
            ) from err
        self._manifests[key] = (hashlib.sha256(data).digest(), None, manifest)


class Store:
    """The tiers of one store, nearest first: a hot tier, a cold tier, or both.

    ``Store("/nvme/run1", "s3://bucket/run1", cold_options={...})``. Building one sends no
    request; each tier's backend is opened on first use. A store pickles without its open
    backends, so it can travel to DCP's background saver and to worker processes.

    ``node_local=True`` says the hot tier is per node (NVMe): each node's hot root holds only
    its own ranks' files, so a hot manifest is not a commit of the whole checkpoint and only
    the cold tier's is (:attr:`committed_tiers`), unless the checkpoint is protected by
    copies on other nodes (:attr:`peers`, :meth:`with_peers`).
    """

    def __init__(
        self,
        hot: TierURL | None = None,
        cold: TierURL | None = None,
        *,
        hot_options: Mapping[str, Any] | None = None,
        cold_options: Mapping[str, Any] | None = None,
        node_local: bool = False,
    ) -> None:
        if hot is None and cold is None:
            raise ConfigError("a store needs at least one tier: pass hot= (and optionally cold=)")
        self.hot = Tier("hot", hot, hot_options) if hot is not None else None
        self.cold = Tier("cold", cold, cold_options) if cold is not None else None
        self.node_local = self._check_node_local(node_local)
        self.peers: Tier | None = None

    def _check_node_local(self, node_local: bool) -> bool:
        if not isinstance(node_local, bool):
            raise ConfigError(f"node_local must be True or False, got {node_local!r}")
        if node_local and (self.hot is None or self.cold is None):
            raise ConfigError("node_local=True needs both a hot and a cold tier")
        return node_local

    @classmethod
    def of(
        cls,
        hot: TierURL | Store | None,
        cold: TierURL | None = None,
        *,
        hot_options: Mapping[str, Any] | None = None,
        cold_options: Mapping[str, Any] | None = None,
        node_local: bool | None = None,
    ) -> Store:
        """``hot`` itself if it is a :class:`Store`, else a store built from the URLs.

        A store given with ``cold`` or options as well is a :class:`~tierstore.errors.ConfigError`:
        the store already says what they would. ``node_local=True`` with a store that is not
        node-local gives the same tiers (their open backends shared) as a node-local store.
        """
        if isinstance(hot, Store):
            if cold is not None or hot_options or cold_options:
                raise ConfigError("pass either a Store or tier URLs and options, not both")
            if node_local is None or node_local == hot.node_local:
                return hot
            return cls.of_tiers(hot.hot, hot.cold, node_local=node_local)
        return cls(hot, cold, hot_options=hot_options, cold_options=cold_options, node_local=bool(node_local))

    @classmethod
    def of_tiers(cls, hot: Tier | None, cold: Tier | None, *, node_local: bool = False) -> Store:
        """A store of tiers already built (sharing their open backends)."""
        if hot is None and cold is None:
            raise ConfigError("a store needs at least one tier")
        store = cls.__new__(cls)
        store.hot, store.cold = hot, cold
        store.node_local = store._check_node_local(node_local)
        store.peers = None
        return store

    def with_peers(self, peers: Tier) -> Store:
        """This node-local store (its tiers shared) whose hot root also keeps copies of other
        nodes' files in ``peers`` (:mod:`tierstore.redundancy`): a checkpoint protected there
        is found and loaded from it first, the cold tier only for what it lacks."""
        if not self.node_local:
            raise ConfigError(
                "copies on other nodes need a node-local store: Store(hot, cold, node_local=True)"
            )
        store = Store.of_tiers(self.hot, self.cold, node_local=True)
        store.peers = peers
        return store

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, nearest first."""
        return [t for t in (self.hot, self.cold) if t is not None]

    @property
    def committed_tiers(self) -> list[Tier]:
        """The tiers whose manifest commits a whole checkpoint, nearest first: every tier,
        or only the cold one when the hot tier is node-local."""
        return [t for t in self.tiers if not (self.node_local and t is self.hot)]

    def holders(self, manifest: Manifest, among: Sequence[Tier] | None = None) -> list[Tier]:
        """The tiers (of ``among``, default :attr:`tiers`) that hold ``manifest``'s attempt
        committed now, nearest first (:meth:`Tier.holds`)."""
        return [t for t in (self.tiers if among is None else among) if t.holds(manifest)]

    @property
    def label(self) -> str:
        """The tiers as error messages name them (credentials redacted)."""
        return ", ".join(t.label for t in self.tiers)

    def migration_pair(self) -> tuple[Tier, Tier]:
        """The hot and the cold tier; a :class:`~tierstore.errors.ConfigError` if one is missing."""
        if self.hot is None or self.cold is None:
            raise ConfigError(
                f"migration needs both a hot and a cold tier; {self!r} has only the {self.tiers[0].role} tier"
            )
        return self.hot, self.cold

    def check_schemes(self) -> None:
        """Raise :class:`~tierstore.errors.BackendNotFound` now for a URL no backend serves."""
        for tier in self.tiers:
            tier.check_scheme()

    def __repr__(self) -> str:
        urls = ", ".join(f"{t.role}={redact_url(t.url)!r}" for t in self.tiers)
        return f"Store({urls}{', node_local=True' if self.node_local else ''})"
