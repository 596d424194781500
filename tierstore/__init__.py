"""tierstore: tiered, crash-consistent storage for PyTorch Distributed Checkpoint.

::

    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, TieredReader

    dcp.async_save(state, storage_writer=TieredWriter(hot="/nvme/run1", step=1200))
    dcp.load(state, storage_reader=TieredReader(hot="/nvme/run1"))  # newest committed
"""

from tierstore._version import __version__
from tierstore.catalog import CheckpointInfo, latest_checkpoint, list_checkpoints
from tierstore.errors import (
    BackendNotFound,
    CheckpointExists,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigError,
    IntegrityError,
    InvalidManifest,
    PublishConflict,
    StorageError,
    TierstoreError,
)
from tierstore.manifest import FileEntry, Manifest
from tierstore.migrator import (
    MigrationConfig,
    MigrationState,
    MigrationStatus,
    migrate_pending,
    migration_status,
    wait_for_migrations,
)
from tierstore.reader import TieredReader
from tierstore.registry import register_backend
from tierstore.restore import restore
from tierstore.writer import TieredWriter

__all__ = [
    "__version__",
    "TieredWriter",
    "TieredReader",
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
    "TierstoreError",
    "ConfigError",
    "BackendNotFound",
    "StorageError",
    "PublishConflict",
    "CheckpointNotFound",
    "CheckpointExists",
    "IntegrityError",
    "InvalidManifest",
    "ChecksumMismatch",
]
