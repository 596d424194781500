"""The one verified read: every caller reports the same damage with the same message.

Each damage is made to a real local tier, then found by the verified read itself, by the
DCP reader (``dcp.load``), by scrub (``verify_store``) and by transfer (``restore`` copying
the damaged cold copy into an empty hot tier). All four must raise or report exactly the
message written out literally below: file, checkpoint and tier named, in one format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
from helpers import DATA_FILE, committed, file_path, flip, load_error, save

from tierstore import ReaderOptions, Store
from tierstore.errors import ChecksumMismatch
from tierstore.format import layout
from tierstore.format.manifest import Manifest, _checksum
from tierstore.format.verified import verify_file
from tierstore.lifecycle.scrub import verify_store
from tierstore.migration.restore import restore
from tierstore.tiers.tier import Tier


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 7)


def _rewrite_entry_size(root: str, manifest: Manifest) -> None:
    """A manifest (self-checksum valid) recording one byte less than the intact file has."""
    key = Path(root, layout.manifest_key(manifest.name))
    body = json.loads(key.read_text())
    body.pop("checksum")
    for entry in body["files"]:
        if entry["path"] == DATA_FILE:
            entry["size"] -= 1
    body["checksum"] = _checksum(body)
    key.write_text(json.dumps(body))


# damage -> (harm the cold copy, expected "<what> mismatch: expected X, found Y" from the entry and bytes)
Expect = Callable[[int, int, int, int], str]
DAMAGES: dict[str, tuple[str, Expect]] = {
    "corrupt byte": (
        "flip",
        lambda size, crc, stored, found: f"CRC32C mismatch: expected {crc:08x}, found {found:08x}",
    ),
    "truncated": (
        "cut",
        lambda size, crc, stored, found: f"size mismatch: expected {size} bytes, found {stored} bytes",
    ),
    "extra bytes": (
        "append",
        lambda size, crc, stored, found: f"size mismatch: expected {size} bytes, found {stored} bytes",
    ),
    "wrong size": (
        "entry",
        lambda size, crc, stored, found: f"size mismatch: expected {size - 1} bytes, found {stored} bytes",
    ),
}


@pytest.fixture(params=list(DAMAGES))
def damaged(request, tmp_path: Path) -> tuple[str, Manifest, str]:
    """A cold tier whose only checkpoint has ``DATA_FILE`` damaged; the message expected."""
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1)
    shutil.copytree(hot, cold)  # a local cold tier: the same layout, committed by its manifest
    manifest = committed(cold, 1, "cold")
    entry = manifest.file(DATA_FILE)
    assert entry is not None
    harm, expect = DAMAGES[request.param]
    path = file_path(cold, manifest)
    {"flip": flip, "cut": _cut, "append": _append, "entry": lambda _: _rewrite_entry_size(cold, manifest)}[
        harm
    ](path)
    stored = path.read_bytes()
    label = Tier("cold", cold).label
    message = (
        f"{expect(entry.size, entry.crc32c, len(stored), crc32c.crc32c(stored))} "
        f"[checkpoint '{manifest.name}', file '{DATA_FILE}', tier '{label}']"
    )
    return cold, committed(cold, 1, "cold"), message


def test_the_verified_read_itself_on_the_local_backend(damaged) -> None:
    cold, manifest, message = damaged
    tier = Tier("cold", cold)
    entry = manifest.file(DATA_FILE)
    assert entry is not None
    with pytest.raises(ChecksumMismatch) as info:
        verify_file(
            tier.backend,
            tier.file_key(manifest.name, manifest.attempt, DATA_FILE),
            entry,
            checkpoint=manifest.name,
            tier=tier.label,
            chunk_size=64,
        )
    assert str(info.value) == message
    assert (info.value.checkpoint, info.value.file, info.value.tier) == (manifest.name, DATA_FILE, tier.label)


def test_dcp_load_reports_it(damaged) -> None:
    cold, manifest, message = damaged
    err = load_error(None, cold, name=manifest.name, options=ReaderOptions(lease=False))
    assert isinstance(err, ChecksumMismatch) and str(err) == message


def test_scrub_reports_it(damaged) -> None:
    cold, manifest, message = damaged
    checks = {c.file: c for c in verify_store(Store(cold=cold))}
    assert checks[".metadata"].ok
    assert not checks[DATA_FILE].ok and checks[DATA_FILE].problem == message


def test_restore_refuses_to_copy_it(damaged, tmp_path: Path) -> None:
    cold, manifest, message = damaged
    hot = str(tmp_path / "fresh-hot")
    with pytest.raises(ChecksumMismatch) as info:
        restore(Store.of(hot, cold))
    assert str(info.value) == message
    assert not Path(hot, layout.file_key(manifest.name, manifest.attempt, DATA_FILE)).exists()
    assert Tier("hot", hot).find_manifest(manifest.name) is None
