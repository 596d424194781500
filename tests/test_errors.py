"""The error tree: builtin bases, messages naming checkpoint, file and tier, pickling."""

from __future__ import annotations

import pickle

from tierstore.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    ObjectNotFound,
    StorageError,
    TierstoreError,
)


def test_error_tree_and_pickling() -> None:
    err = ChecksumMismatch(
        "CRC32C mismatch", checkpoint="c", file="f", tier="hot /x", expected="0a", actual="0b"
    )
    assert isinstance(err, TierstoreError) and isinstance(err, ValueError)
    assert "checkpoint 'c'" in str(err) and "file 'f'" in str(err) and "tier 'hot /x'" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ChecksumMismatch and str(back) == str(err) and back.actual == "0b"
    assert issubclass(ObjectNotFound, FileNotFoundError) and issubclass(ObjectNotFound, StorageError)
    assert issubclass(CheckpointNotFound, FileNotFoundError)
