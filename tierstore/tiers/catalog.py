"""What a store holds: the committed checkpoints its tiers' manifests make up.

A checkpoint exists in a tier if and only if the tier holds its valid manifest (docs/design.md
invariant 1): nothing here looks at data files, DCP's ``.metadata`` or directory names.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from tierstore.errors import CheckpointNotFound, InvalidManifest, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["CheckpointInfo", "list_checkpoints", "latest_checkpoint", "resolve"]

log = logging.getLogger(__name__)


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
    # The metrics its save recorded ({} when none). Not hashed: a dict is not hashable.
    metrics: dict[str, float] = field(default_factory=dict, hash=False)
    # The run it was saved for, when one was named (CheckpointManager(run=), TieredWriter(run=)).
    run: str | None = None
    # The scheduler's id of the job that saved it ("slurm job 4242"), for display only.
    job: str | None = None
    # The fingerprint of the saved state's structure (docs/format.md); None: not recorded.
    fingerprint: str | None = None

    @classmethod
    def of(cls, manifest: Manifest, tiers: Iterable[str]) -> CheckpointInfo:
        return cls(
            name=manifest.name,
            step=manifest.step,
            attempt=manifest.attempt,
            created=manifest.created,
            world_size=manifest.world_size,
            size=manifest.total_size,
            num_files=manifest.num_files,
            tiers=tuple(tiers),
            metrics=manifest.metrics,
            run=manifest.run,
            job=manifest.job,
            fingerprint=manifest.fingerprint,
        )


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
            log.warning(
                "ignoring the invalid manifest of checkpoint %s in %s, %s holds a valid one: %s",
                err.checkpoint,
                tier.label,
                elsewhere[0].label,
                err,
            )
        else:
            log.warning(
                "skipping checkpoint %s: its manifest is invalid in %s and no other tier "
                "holds a valid one: %s",
                err.checkpoint,
                tier.label,
                err,
            )
    return sorted(merged.values(), key=lambda item: checkpoint_order(item[0]))


def list_checkpoints(store: Store | TierURL) -> list[CheckpointInfo]:
    """Committed checkpoints in any tier of ``store``, sorted by step (then creation time)."""
    tiers = Store.of(store).tiers
    return [CheckpointInfo.of(m, (t.role for t in holders)) for m, holders in _collect(tiers)]


def latest_checkpoint(store: Store | TierURL) -> CheckpointInfo | None:
    """The newest committed checkpoint in any tier, or ``None`` for an empty store."""
    found = list_checkpoints(store)
    return found[-1] if found else None


def resolve(
    tiers: Sequence[Tier],
    *,
    step: int | None = None,
    name: str | None = None,
    exclude: Collection[tuple[str, str]] = (),
) -> tuple[Manifest, list[Tier]]:
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
    candidates = [
        (m, ts)
        for m, ts in _collect(tiers)
        if (step is None or m.step == step) and (m.name, m.attempt) not in exclude
    ]
    if not candidates:
        what = "no committed checkpoint" if step is None else f"no committed checkpoint of step {step}"
        if exclude:
            what += " besides the damaged ones skipped"
        raise CheckpointNotFound(what, tier=where)
    return candidates[-1]


def _find(tier: Tier, name: str) -> Manifest | InvalidManifest | None:
    """The tier's valid manifest of ``name``, the error of an invalid one, or ``None``."""
    try:
        return tier.find_manifest(name)
    except InvalidManifest as err:
        return err


def _quarantined(tiers: Sequence[Tier], name: str) -> str:
    """`` (quarantined in ...)`` when a tier holds a quarantine record of ``name``."""
    held = []
    for tier in tiers:
        try:
            if any(True for _ in tier.backend.list(layout.quarantine_prefix(name))):
                held.append(tier.label)
        except TierstoreError:
            continue  # only a hint for the message
    if not held:
        return ""
    return (
        f": it is quarantined (found damaged by a resume) in {', '.join(held)}; "
        "`tierstore quarantine` shows why"
    )


def _resolve_name(tiers: Sequence[Tier], name: str, where: str) -> tuple[Manifest, list[Tier]]:
    found = [(_find(tier, name), tier) for tier in tiers]
    holders = [(m, tier) for m, tier in found if isinstance(m, Manifest)]
    invalid = [m for m, _ in found if isinstance(m, InvalidManifest)]
    if not holders:
        if invalid:
            raise invalid[0]
        raise CheckpointNotFound(
            "no committed checkpoint of that name" + _quarantined(tiers, name), checkpoint=name, tier=where
        )
    for bad in invalid:
        log.warning(
            "ignoring an invalid manifest of checkpoint %s, reading the valid one in %s: %s",
            name,
            holders[0][1].label,
            bad,
        )
    first = holders[0][0]
    return first, [t for m, t in holders if m.attempt == first.attempt]
