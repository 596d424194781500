"""tierstore: tiered, crash-consistent storage for PyTorch Distributed Checkpoint.

::

    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TieredReader

    dcp.async_save(state, storage_writer=TieredWriter(hot="/nvme/run1", step=1200))
    dcp.load(state, storage_reader=TieredReader(hot="/nvme/run1"))  # newest committed

Names that need torch (the DCP writer and reader, the manager, ``TrainingState``) are
imported on first use, so the ``tierstore`` command and storage-only tools start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierstore._version import __version__
from tierstore.errors import (
    BackendNotFound,
    CheckpointExists,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigError,
    IntegrityError,
    InvalidManifest,
    MigrationFailed,
    PublishConflict,
    SaveFailed,
    StorageError,
    TierstoreError,
    UnsafeType,
)
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.quarantine import list_quarantined
from tierstore.lifecycle.retention import (
    keep_all,
    keep_best,
    keep_every,
    keep_last,
    keep_steps,
    keep_within,
)
from tierstore.resume.cadence import CadencePlan, TimeCadence, optimal_interval
from tierstore.resume.check import Probe, ResumeReport, verify_checkpoint, verify_resume
from tierstore.resume.data import ResumableLoader, ResumableSampler
from tierstore.storage.registry import register_backend
from tierstore.tiers.catalog import CheckpointInfo, latest_checkpoint, list_checkpoints
from tierstore.tiers.migrator import MigrationConfig, MigrationState, MigrationStatus
from tierstore.tiers.restore import RestoreReport, restore, restore_checkpoint
from tierstore.tiers.status import migrate_pending, migration_status, wait_for_migrations
from tierstore.tiers.tier import Store

if TYPE_CHECKING:
    from tierstore.dcp.reader import TieredReader
    from tierstore.dcp.writer import TieredWriter
    from tierstore.manager import CheckpointManager, Health
    from tierstore.resume.state import ResumePlanner, TrainingState

_LAZY = {
    "TieredWriter": "tierstore.dcp.writer",
    "TieredReader": "tierstore.dcp.reader",
    "CheckpointManager": "tierstore.manager",
    "Health": "tierstore.manager",
    "TrainingState": "tierstore.resume.state",
    "ResumePlanner": "tierstore.resume.state",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tierstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public API, lazy names included; not the imports this module works with.
    return sorted(__all__)



__all__ = [
    "__version__",
    "TieredWriter",
    "TieredReader",
    "CheckpointManager",
    "Health",
    "Store",
    "list_checkpoints",
    "latest_checkpoint",
    "CheckpointInfo",
    "Manifest",
    "FileEntry",
    "register_backend",
    "MigrationConfig",
    "MigrationState",
    "MigrationStatus",
    "migrate_pending",
    "migration_status",
    "wait_for_migrations",
    "restore",
    "restore_checkpoint",
    "RestoreReport",
    "prune",
    "list_quarantined",
    "collect_garbage",
    "find_garbage",
    "keep_last",
    "keep_best",
    "keep_every",
    "keep_steps",
    "keep_within",
    "keep_all",
    "TrainingState",
    "ResumePlanner",
    "ResumableSampler",
    "ResumableLoader",
    "optimal_interval",
    "CadencePlan",
    "TimeCadence",
    "Probe",
    "ResumeReport",
    "verify_resume",
    "verify_checkpoint",
    "TierstoreError",
    "ConfigError",
    "BackendNotFound",
    "StorageError",
    "PublishConflict",
    "SaveFailed",
    "MigrationFailed",
    "CheckpointNotFound",
    "CheckpointExists",
    "UnsafeType",
    "IntegrityError",
    "InvalidManifest",
    "ChecksumMismatch",
]
