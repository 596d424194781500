"""The package's face (issue 36): about thirty names, one per job, in three groups (core,
operations, errors), pinned here; a name the package does not export is an AttributeError
saying which module holds it. tierstore 0.1.0 is the first release, so no old name lingers."""

from __future__ import annotations

import importlib

import pytest

import tierstore

CORE = {
    "__version__",
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
    "Replicas",  # copies on other nodes (issue 37)
    "Parity",
    "TrainingState",
    "ResumePlanner",
    "ResumableSampler",
    "ResumableLoader",
}
OPERATIONS = {
    "prune",
    "collect_garbage",
    "migrate_pending",
    "migration_status",
    "restore",
    "export",
    "verify_resume",
    "Probe",
}
ERRORS = {
    "TierstoreError",
    "ConfigError",
    "StorageError",
    "IntegrityError",
    "CheckpointNotFound",
    "CheckpointExists",
    "SaveFailed",
    "MigrationFailed",
}

# Names that live only in their modules (some exported by the package before issue 36).
ELSEWHERE = {
    "CheckpointInfo": "tierstore.tiers.catalog",
    "keep_steps": "tierstore.lifecycle.retention",
    "keep_within": "tierstore.lifecycle.retention",
    "keep_best": "tierstore.lifecycle.retention",
    "keep_all": "tierstore.lifecycle.retention",
    "list_quarantined": "tierstore.lifecycle.quarantine",
    "wait_for_migrations": "tierstore.migration.status",
    "copy_checkpoint": "tierstore.migration.copy",
    "restore_checkpoint": "tierstore.migration.restore",
    "TimeCadence": "tierstore.resume.cadence",
    "optimal_interval": "tierstore.resume.cadence",
    "register_backend": "tierstore.storage.registry",
    "Health": "tierstore.manager",
    "ManagerOptions": "tierstore.options",
    "Manifest": "tierstore.format.manifest",
    "MigrationStatus": "tierstore.migration.migrator",
}


def test_the_public_api_is_core_operations_and_errors() -> None:
    assert set(tierstore.__all__) == CORE | OPERATIONS | ERRORS
    assert len(tierstore.__all__) == len(set(tierstore.__all__)) == 37
    assert set(dir(tierstore)) == set(tierstore.__all__)
    for name in tierstore.__all__:
        assert getattr(tierstore, name) is not None


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_a_name_not_exported_is_an_attribute_error_naming_its_module(name: str) -> None:
    module = ELSEWHERE[name]
    with pytest.raises(AttributeError, match=f"import it from {module}"):
        getattr(tierstore, name)
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("name", ["latest_checkpoint", "find_garbage", "no_such_name"])
def test_an_unknown_name_is_an_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=name):
        getattr(tierstore, name)
