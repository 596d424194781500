"""tierstore: tiered, crash-consistent storage for PyTorch Distributed Checkpoint.

::

    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TieredReader

    dcp.async_save(state, storage_writer=TieredWriter(hot="/nvme/run1", step=1200))
    dcp.load(state, storage_reader=TieredReader(hot="/nvme/run1"))  # newest committed

The public API is one name per job, in three groups (docs/index.md): the core (saving,
loading, the manager, retention, resume), operations on a store, and the errors one catches.
Every other error is in :mod:`tierstore.errors`, and the types of reports in the module that
returns them. Names that need torch (the DCP writer and reader, ``export``, the manager,
``TrainingState``) are imported on first use, so the ``tierstore`` command and storage-only
tools start without importing torch.
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
from tierstore.lifecycle.quarantine import list_quarantined
from tierstore.lifecycle.retention import (
    Retention,
    keep_all,
    keep_best,
    keep_every,
    keep_last,
    keep_steps,
    keep_within,
)
from tierstore.migration.copy import copy_checkpoint
from tierstore.migration.migrator import MigrationConfig
from tierstore.migration.restore import restore
from tierstore.migration.status import migrate_pending, migration_status, wait_for_migrations
from tierstore.options import Preemption, ReaderOptions, Run, StagingOptions, WriterOptions
from tierstore.resume.cadence import TimeCadence, optimal_interval
from tierstore.resume.check import Probe, verify_resume
from tierstore.resume.data import ResumableLoader, ResumableSampler
from tierstore.storage.registry import register_backend
from tierstore.tiers.catalog import CheckpointInfo, list_checkpoints
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

# Names the package exported before it kept one name per job: they still work, for one
# release, with a DeprecationWarning saying where they live (or what does their job).
_MOVED = {  # module -> the names that now live only there
    "tierstore.migration.restore": ("restore_checkpoint", "RestoreReport"),
    "tierstore.resume.check": ("verify_checkpoint",),
    "tierstore.manager": ("Health",),
    "tierstore.format.manifest": ("Manifest", "FileEntry"),
    "tierstore.migration.migrator": ("MigrationState", "MigrationStatus"),
    "tierstore.resume.cadence": ("CadencePlan",),
    "tierstore.resume.report": ("ResumeReport",),
    "tierstore.errors": (
        "BackendNotFound",
        "PublishConflict",
        "UnsafeType",
        "InvalidManifest",
        "ChecksumMismatch",
    ),
}
_DEPRECATED = {  # old name -> (its module, what to use instead)
    "latest_checkpoint": ("tierstore.tiers.catalog", "list_checkpoints(...)[-1]"),
    "find_garbage": ("tierstore.lifecycle.gc", "collect_garbage(..., dry_run=True).garbage"),
    **{name: (module, f"{module}.{name}") for module, names in _MOVED.items() for name in names},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _DEPRECATED:
        module, instead = _DEPRECATED[name]
        from tierstore.options import warn_deprecated

        warn_deprecated(name, f": use {instead} (the old name goes in the next release)", stacklevel=2)
        return getattr(importlib.import_module(module), name)
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
    "WriterOptions",
    "ReaderOptions",
    "StagingOptions",
    "Preemption",
    "Run",
    "Store",
    "list_checkpoints",
    "CheckpointInfo",
    "Retention",
    "keep_last",
    "keep_every",
    "keep_steps",
    "keep_within",
    "keep_best",
    "keep_all",
    "TrainingState",
    "ResumePlanner",
    "ResumableLoader",
    "ResumableSampler",
    "TimeCadence",
    "optimal_interval",
    # operations on a store
    "prune",
    "collect_garbage",
    "migrate_pending",
    "migration_status",
    "wait_for_migrations",
    "restore",
    "copy_checkpoint",
    "list_quarantined",
    "export",
    "verify_resume",
    "Probe",
    "MigrationConfig",
    "register_backend",
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
