"""The package's face (issue 23 item 6): one name per job, in three groups, and the names it
exported before still work for one release, each with a DeprecationWarning saying where it
lives now."""

from __future__ import annotations

import importlib
import warnings

import pytest

import tierstore

OLD = [
    "latest_checkpoint",
    "find_garbage",
    "restore_checkpoint",
    "verify_checkpoint",
    "Health",
    "Manifest",
    "FileEntry",
    "MigrationState",
    "MigrationStatus",
    "RestoreReport",
    "CadencePlan",
    "ResumeReport",
    "BackendNotFound",
    "PublishConflict",
    "UnsafeType",
    "InvalidManifest",
    "ChecksumMismatch",
]


def test_the_public_api_is_about_thirty_names_one_per_job() -> None:
    # The constructors' options objects are part of their constructor's job, not jobs of their own.
    options = {
        "WriterOptions",
        "ReaderOptions",
        "StagingOptions",
        "Retention",
        "MigrationConfig",
        "Preemption",
        "Run",
    }
    assert len(set(tierstore.__all__) - options) <= 39
    assert not set(OLD) & set(tierstore.__all__)
    assert set(dir(tierstore)) == set(tierstore.__all__)
    for name in tierstore.__all__:
        assert getattr(tierstore, name) is not None


@pytest.mark.parametrize("name", OLD)
def test_an_old_name_works_with_a_warning_naming_its_place(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(tierstore, name)
    assert [w.category for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    assert f"tierstore.{name} is deprecated" in message
    module = tierstore._DEPRECATED[name][0]
    assert value is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        tierstore.no_such_name  # noqa: B018
