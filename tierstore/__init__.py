"""tierstore: tiered, crash-consistent storage for PyTorch Distributed Checkpoint.

::

    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TieredReader

    dcp.async_save(state, storage_writer=TieredWriter("/nvme/run1", step=1200))
    dcp.load(state, storage_reader=TieredReader("/nvme/run1"))  # newest committed

The public API is one name per job, in three groups (docs/index.md): the core (saving,
loading, the manager, retention, resume), operations on a store, and the errors one catches.
Every other error is in :mod:`tierstore.errors`, the types of reports in the module that
returns them, and the rest (more retention policies, the cadence, the less common operations)
in their modules, each named in docs/index.md. Names that need torch (the DCP writer and
reader, ``export``, the manager, ``TrainingState``) are imported on first use, so the
``tierstore`` command and storage-only tools start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierstore._version import __version__
from tierstore.errors import (
    CheckpointExists,
    CheckpointNotFound,
    ConfigError,
    IntegrityError,
    MigrationFailed,
    SaveFailed,
    StorageError,
    TierstoreError,
)
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import Retention, keep_every, keep_last
from tierstore.migration.migrator import MigrationOptions
from tierstore.migration.restore import restore
from tierstore.migration.status import migrate_pending, migration_status
from tierstore.options import PreemptionOptions, ReaderOptions, RunOptions, StagingOptions, WriterOptions
from tierstore.redundancy import Parity, Replicas
from tierstore.resume.check import Probe, verify_resume
from tierstore.resume.data import ResumableLoader, ResumableSampler
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.tier import Store

if TYPE_CHECKING:
    from tierstore.dcp.export import export
    from tierstore.dcp.reader import TieredReader
    from tierstore.dcp.writer import TieredWriter
    from tierstore.manager import CheckpointManager
    from tierstore.resume.state import ResumePlanner, TrainingState

_LAZY = {
    "TieredWriter": "tierstore.dcp.writer",
    "TieredReader": "tierstore.dcp.reader",
    "CheckpointManager": "tierstore.manager",
    "TrainingState": "tierstore.resume.state",
    "ResumePlanner": "tierstore.resume.state",
    "export": "tierstore.dcp.export",
}

# Public names that are not the package's (one job among many, a report's type, a policy
# most runs never name), and where they live: only so that an AttributeError says where.
_ELSEWHERE = {
    "tierstore.tiers.catalog": ("CheckpointInfo",),
    "tierstore.lifecycle.retention": ("keep_steps", "keep_within", "keep_best", "keep_all"),
    "tierstore.lifecycle.quarantine": ("list_quarantined",),
    "tierstore.migration.status": ("wait_for_migrations",),
    "tierstore.migration.copy": ("copy_checkpoint",),
    "tierstore.migration.restore": ("restore_checkpoint", "RestoreReport"),
    "tierstore.migration.migrator": ("MigrationState", "MigrationStatus"),
    "tierstore.resume.cadence": ("TimeCadence", "optimal_interval", "CadencePlan"),
    "tierstore.resume.check": ("verify_checkpoint",),
    "tierstore.resume.report": ("ResumeReport",),
    "tierstore.storage.registry": ("register_backend",),
    "tierstore.manager": ("Health",),
    "tierstore.options": ("ManagerOptions",),
    "tierstore.format.manifest": ("Manifest", "FileEntry"),
}
_WHERE = {name: module for module, names in _ELSEWHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _WHERE:
        raise AttributeError(
            f"module 'tierstore' has no attribute {name!r}: import it from {_WHERE[name]} "
            f"(from {_WHERE[name]} import {name})"
        )
    raise AttributeError(f"module 'tierstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public API, lazy names included; not the imports this module works with.
    return sorted(__all__)


__all__ = [
    "__version__",
    # the core: save, load, manage, retain, resume
    "TieredWriter",
    "TieredReader",
    "CheckpointManager",
    "Store",
    "list_checkpoints",
    "WriterOptions",
    "ReaderOptions",
    "StagingOptions",
    "MigrationOptions",
    "PreemptionOptions",
    "RunOptions",
    "Retention",
    "keep_last",
    "keep_every",
    "Replicas",
    "Parity",
    "TrainingState",
    "ResumePlanner",
    "ResumableSampler",
    "ResumableLoader",
    # operations on a store
    "prune",
    "collect_garbage",
    "migrate_pending",
    "migration_status",
    "restore",
    "export",
    "verify_resume",
    "Probe",
    # the errors one catches (every error: tierstore.errors)
    "TierstoreError",
    "ConfigError",
    "StorageError",
    "IntegrityError",
    "CheckpointNotFound",
    "CheckpointExists",
    "SaveFailed",
    "MigrationFailed",
]
