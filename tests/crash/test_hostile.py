"""Hostile input: traversal and absolute paths, a symlinked file, a forged manifest, absurd
sizes. Each is rejected with a clear error, and an audit hook proves no file outside the
store's own checkpoint was opened while trying."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import model
import pytest
import torch.distributed.checkpoint as dcp
from stats import STATS

from tierstore import TieredWriter
from tierstore.errors import ChecksumMismatch, IntegrityError, InvalidManifest, UnsafePath
from tierstore.format import layout
from tierstore.format.manifest import _checksum
from tierstore.storage.backend import crc32c_update

OPENED: list[str] = []
AUDITING = [False]


def _audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    if AUDITING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # process-wide and permanent (Python offers no removal): gated


@contextmanager
def watching_opens() -> Iterator[list[str]]:
    OPENED.clear()
    AUDITING[0] = True
    try:
        yield OPENED
    finally:
        AUDITING[0] = False


@pytest.fixture
def store_paths(tmp_path: Path) -> dict[str, Path]:
    hot = tmp_path / "hot"
    dcp.save(model.state_for(1), storage_writer=TieredWriter(str(hot), step=1))
    secret = tmp_path / "secret.distcp"
    secret.write_bytes(b"outside the store" * 100)
    return {"hot": hot, "secret": secret, "manifest": hot / layout.manifest_key(layout.default_name(1))}


def tamper(path: Path, mutate, *, reseal: bool = True) -> None:
    body = json.loads(path.read_text())
    mutate(body)
    if reseal:  # a forger who also fixes up the manifest's own checksum
        body.pop("checksum")
        body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))


def load_error(store_paths: dict[str, Path]) -> BaseException:
    with watching_opens() as opened, pytest.raises(BaseException) as info:
        model.load(str(store_paths["hot"]), None, layout.default_name(1))
    STATS.faults += 1
    code = (".py", ".pyc", ".so")  # Python reading its own modules (lazy imports, tracebacks)
    # Relative names are opened relative to a directory the local backend walked from the
    # root without following links (dir_fd): inside by construction. The root is absolute.
    outside = [
        p
        for p in opened
        if os.path.isabs(p)
        and not os.path.realpath(p).startswith(os.path.realpath(store_paths["hot"]))
        and not p.endswith(code)
        and not p.startswith(("/proc/", "/dev/", sys.prefix))
    ]
    assert not any(os.path.realpath(p) == os.path.realpath(store_paths["secret"]) for p in opened), opened
    assert outside == [], f"opened outside the store: {outside}"
    return model.unwrap(info.value)


@pytest.mark.parametrize("path", ["../../secret.distcp", "/etc/passwd", "../../../../../../etc/shadow"])
def test_traversal_and_absolute_paths(store_paths: dict[str, Path], path: str) -> None:
    tamper(store_paths["manifest"], lambda b: b["files"][1].update(path=path))
    err = load_error(store_paths)
    assert isinstance(err, InvalidManifest) and "unsafe file path" in str(err)


def test_symlinked_file(store_paths: dict[str, Path]) -> None:
    manifest = json.loads(store_paths["manifest"].read_text())
    shard = store_paths["hot"] / layout.file_key(manifest["name"], manifest["attempt"], "__0_0.distcp")
    shard.unlink()
    os.symlink(store_paths["secret"], shard)
    err = load_error(store_paths)
    assert isinstance(err, UnsafePath) and "__0_0.distcp" in str(err)


def test_forged_manifest_for_foreign_bytes(store_paths: dict[str, Path]) -> None:
    # The forger points an entry at a file of their choosing by copying it in, re-sealed:
    # sizes must still match the bytes, and DCP's metadata must still parse as metadata.
    manifest = json.loads(store_paths["manifest"].read_text())
    shard = store_paths["hot"] / layout.file_key(manifest["name"], manifest["attempt"], "__0_0.distcp")
    shard.write_bytes(store_paths["secret"].read_bytes())
    tamper(store_paths["manifest"], lambda b: None, reseal=False)  # the original checksums now lie
    err = load_error(store_paths)
    assert isinstance(err, ChecksumMismatch) and err.file == "__0_0.distcp"


def test_forged_manifest_with_matching_checksums_cannot_smuggle_code(
    store_paths: dict[str, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "owned"
    evil = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    manifest = json.loads(store_paths["manifest"].read_text())
    meta = store_paths["hot"] / layout.file_key(manifest["name"], manifest["attempt"], ".metadata")
    meta.write_bytes(evil)
    tamper(
        store_paths["manifest"],
        lambda b: [
            f.update(size=len(evil), crc32c=crc32c_update(0, evil))
            for f in b["files"]
            if f["path"] == ".metadata"
        ],
    )
    err = load_error(store_paths)
    assert isinstance(err, IntegrityError) and "cannot be loaded safely" in str(err)
    assert not marker.exists()


@pytest.mark.parametrize("size", [1 << 40, (1 << 50) + 1, -1])
def test_absurd_sizes(store_paths: dict[str, Path], size: int) -> None:
    tamper(store_paths["manifest"], lambda b: b["files"][1].update(size=size))
    err = load_error(store_paths)  # 1 TiB passes validation, then fails on the stored size at once
    assert isinstance(err, (InvalidManifest, ChecksumMismatch)), err
    assert "absurd size" in str(err) or "size mismatch" in str(err)
