"""How much each tier holds (``tierstore du``): its committed checkpoints' bytes, what else
is stored there, and the local disk's free space.

One listing of the whole tier and one of its manifests: each stored object is counted once,
against the committed checkpoint whose attempt it belongs to (data, ``.metadata``, manifest
parts, and the manifest itself), or else as *other* (marks, leases, dead attempts, stray
files: ``tierstore gc`` says which of it is garbage). Nothing is read but manifests.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.format import layout
from tierstore.format.manifest import checkpoint_order
from tierstore.tiers.tier import Tier

__all__ = ["CheckpointUsage", "TierUsage", "tier_usage"]


@dataclass(frozen=True)
class CheckpointUsage:
    """One committed checkpoint of a tier: ``size`` is what its manifest names (the data),
    ``manifest_bytes`` its manifest's root, ``stored_bytes`` every object of it stored."""

    name: str
    step: int | None
    attempt: str
    size: int
    files: int
    manifest_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class TierUsage:
    """A tier's bytes: all stored (``bytes``), in committed checkpoints, and the rest."""

    role: str
    url: str  # as given: redact before showing (tierstore._redact)
    checkpoints: tuple[CheckpointUsage, ...]
    bytes: int
    objects: int
    free_bytes: int | None  # where the backend can tell (local disks)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.stored_bytes for c in self.checkpoints)

    @property
    def other_bytes(self) -> int:
        """Stored, but in no committed checkpoint: marks, leases, garbage (``tierstore gc``)."""
        return self.bytes - self.checkpoint_bytes


def tier_usage(tier: Tier) -> TierUsage:
    """What ``tier`` holds now (module docstring). Raises the tier's storage error if it
    cannot be listed."""
    manifests = {m.name: m for m in tier.manifests()}
    stored = {name: 0 for name in manifests}
    roots = {name: 0 for name in manifests}
    total = objects = 0
    for info in tier.backend.list(""):
        total += info.size
        objects += 1
        name = layout.parse_manifest_key(info.key)
        if name is not None and name in manifests:
            roots[name] = info.size
            stored[name] += info.size
            continue
        owner = layout.spread_attempt_of(info.key)
        if owner is not None and owner[0] in manifests and manifests[owner[0]].attempt == owner[1]:
            stored[owner[0]] += info.size
    checkpoints = tuple(
        CheckpointUsage(m.name, m.step, m.attempt, m.total_size, m.num_files, roots[m.name], stored[m.name])
        for m in sorted(manifests.values(), key=checkpoint_order)
    )
    return TierUsage(tier.role, tier.url, checkpoints, total, objects, tier.backend.free_bytes())
