"""What a store holds: tiers, their manifests, and the committed checkpoints they make up.

A checkpoint exists in a tier if and only if the tier holds its valid manifest (DESIGN.md
invariant 1): nothing here looks at data files, DCP's ``.metadata`` or directory names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierstore import layout
from tierstore._redact import redact_url
from tierstore.backend import Backend
from tierstore.errors import (
    CheckpointExists,
    CheckpointNotFound,
    ConfigError,
    InvalidManifest,
    ObjectNotFound,
    ObjectTooLarge,
    PublishConflict,
)
from tierstore.manifest import MAX_MANIFEST_BYTES, Manifest
from tierstore.registry import backend_class, open_backend, split_scheme

__all__ = ["Tier", "CheckpointInfo", "list_checkpoints", "latest_checkpoint", "resolve", "make_tiers"]

log = logging.getLogger(__name__)

TierURL = str | os.PathLike[str]


class Tier:
    """A backend in a role (``"hot"`` or ``"cold"``), built lazily and never pickled."""

    def __init__(self, role: str, url: TierURL, options: Mapping[str, Any] | None = None) -> None:
        self.role = role
        self.url = os.fspath(url)
        self.options = dict(options or {})
        self._backend: Backend | None = None

    def __repr__(self) -> str:
        return f"Tier({self.role!r}, {redact_url(self.url)!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_backend": None}

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
        """The valid manifest of ``name``, ``None`` if absent; raises if present but invalid."""
        key = layout.manifest_key(name)
        try:
            data = self.backend.read_bytes(key, limit=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            return None
        return Manifest.from_json(data, key=key, tier=self.label, expect_name=name)

    def manifests(self) -> list[Manifest]:
        """Every valid manifest; invalid ones do not count as checkpoints and are logged."""
        found, invalid = self.scan_manifests()
        for err in invalid:
            log.warning("ignoring checkpoint with an invalid manifest: %s", err)
        return found

    def scan_manifests(self) -> tuple[list[Manifest], list[InvalidManifest]]:
        """Valid manifests, and the errors of invalid ones (torn, corrupt, oversized).

        Other storage errors propagate: a manifest that could not be read is not known to
        be damaged, and callers such as GC must not act as if it were absent.
        """
        found, invalid = [], []
        for info in self.backend.list(layout.MANIFEST_DIR + "/"):
            name = layout.parse_manifest_key(info.key)
            if name is None:
                continue
            try:
                manifest = self._find_valid(name)
            except InvalidManifest as err:
                invalid.append(err)
                continue
            if manifest is not None:
                found.append(manifest)
        return found, invalid

    def _find_valid(self, name: str) -> Manifest | None:
        """:meth:`find_manifest`, with an oversized manifest reported as invalid."""
        try:
            return self.find_manifest(name)
        except ObjectTooLarge as err:
            raise InvalidManifest(f"invalid manifest: {err.message}", key=err.key,
                                  tier=self.label, checkpoint=name) from err

    def publish_manifest(self, manifest: Manifest) -> None:
        """The commit point of ``manifest`` in this tier; never overwrites."""
        key = layout.manifest_key(manifest.name)
        try:
            self.backend.publish(key, manifest.to_json())
        except PublishConflict as err:
            raise CheckpointExists(
                "checkpoint is already committed (by another attempt); committed "
                "checkpoints are never overwritten",
                checkpoint=manifest.name, tier=self.label,
            ) from err


def make_tiers(hot: TierURL | None, cold: TierURL | None = None, *,
               hot_options: Mapping[str, Any] | None = None,
               cold_options: Mapping[str, Any] | None = None) -> list[Tier]:
    """The store's tiers, nearest first."""
    if hot is None and cold is None:
        raise ConfigError("a store needs at least one tier: pass hot= (and optionally cold=)")
    tiers = []
    if hot is not None:
        tiers.append(Tier("hot", hot, hot_options))
    if cold is not None:
        tiers.append(Tier("cold", cold, cold_options))
    return tiers


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint and the tiers that hold it (nearest first)."""

    name: str
    step: int | None
    attempt: str
    created: float
    world_size: int
    size: int
    num_files: int
    tiers: tuple[str, ...]

    @classmethod
    def of(cls, manifest: Manifest, tiers: Iterable[str]) -> CheckpointInfo:
        return cls(
            name=manifest.name,
            step=manifest.step,
            attempt=manifest.attempt,
            created=manifest.created,
            world_size=manifest.world_size,
            size=manifest.total_size,
            num_files=len(manifest.files),
            tiers=tuple(tiers),
        )


def _order(manifest: Manifest) -> tuple[int, float, str]:
    return (-1 if manifest.step is None else manifest.step, manifest.created, manifest.name)


def _collect(tiers: Sequence[Tier]) -> list[tuple[Manifest, list[Tier]]]:
    """Committed checkpoints across tiers, oldest first, each with the tiers that hold it.

    A manifest invalid in one tier does not hide a valid one of the same name in another.
    """
    merged: dict[tuple[str, str], tuple[Manifest, list[Tier]]] = {}
    invalid: list[tuple[InvalidManifest, Tier]] = []
    for tier in tiers:
        found, bad = tier.scan_manifests()
        invalid += [(err, tier) for err in bad]
        for manifest in found:
            entry = merged.setdefault((manifest.name, manifest.attempt), (manifest, []))
            entry[1].append(tier)
    valid = {name: holders for (name, _), (_, holders) in merged.items()}
    for err, tier in invalid:
        elsewhere = valid.get(err.checkpoint or "")
        if elsewhere:
            log.warning("ignoring the invalid manifest of checkpoint %s in %s, %s holds a valid "
                        "one: %s", err.checkpoint, tier.label, elsewhere[0].label, err)
        else:
            log.warning("skipping checkpoint %s: its manifest is invalid in %s and no other tier "
                        "holds a valid one: %s", err.checkpoint, tier.label, err)
    return sorted(merged.values(), key=lambda item: _order(item[0]))


def list_checkpoints(hot: TierURL | None, cold: TierURL | None = None, *,
                     hot_options: Mapping[str, Any] | None = None,
                     cold_options: Mapping[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints in any tier, sorted by step (then creation time)."""
    tiers = make_tiers(hot, cold, hot_options=hot_options, cold_options=cold_options)
    return [CheckpointInfo.of(m, (t.role for t in holders)) for m, holders in _collect(tiers)]


def latest_checkpoint(hot: TierURL | None, cold: TierURL | None = None, *,
                      hot_options: Mapping[str, Any] | None = None,
                      cold_options: Mapping[str, Any] | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint in any tier, or ``None`` for an empty store."""
    found = list_checkpoints(hot, cold, hot_options=hot_options, cold_options=cold_options)
    return found[-1] if found else None


def resolve(tiers: Sequence[Tier], *, step: int | None = None, name: str | None = None,
            exclude: Collection[tuple[str, str]] = ()) -> tuple[Manifest, list[Tier]]:
    """The checkpoint to read and the tiers holding it, nearest first.

    ``name`` picks that checkpoint; ``step`` the newest one of that step; neither, the
    newest committed checkpoint in any tier. Without ``name``, ``(name, attempt)`` pairs in
    ``exclude`` are passed over (a reader skipping damaged checkpoints). A manifest invalid
    in one tier is skipped (logged) when another tier holds a valid one; an explicitly named
    checkpoint whose manifest is invalid in every tier raises that tier's
    :class:`~tierstore.errors.InvalidManifest`.
    """
    where = ", ".join(t.label for t in tiers)
    if name is not None:
        return _resolve_name(tiers, name, where)
    candidates = [(m, ts) for m, ts in _collect(tiers)
                  if (step is None or m.step == step) and (m.name, m.attempt) not in exclude]
    if not candidates:
        what = "no committed checkpoint" if step is None else f"no committed checkpoint of step {step}"
        if exclude:
            what += " besides the damaged ones skipped"
        raise CheckpointNotFound(what, tier=where)
    return candidates[-1]


def _resolve_name(tiers: Sequence[Tier], name: str, where: str) -> tuple[Manifest, list[Tier]]:
    holders: list[tuple[Manifest, Tier]] = []
    invalid: list[InvalidManifest] = []
    for tier in tiers:
        try:
            manifest = tier._find_valid(name)
        except InvalidManifest as err:
            invalid.append(err)
            continue
        if manifest is not None:
            holders.append((manifest, tier))
    if not holders:
        if invalid:
            raise invalid[0]
        raise CheckpointNotFound("no committed checkpoint of that name", checkpoint=name, tier=where)
    for bad in invalid:
        log.warning("ignoring an invalid manifest of checkpoint %s, reading the valid one in %s: %s",
                    name, holders[0][1].label, bad)
    first = holders[0][0]
    return first, [t for m, t in holders if m.attempt == first.attempt]
