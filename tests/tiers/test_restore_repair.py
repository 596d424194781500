"""`restore` repairs a damaged hot copy from verified cold copies, and says what it repaired."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import file_path, flip, load, matches, saved

from tierstore import ReaderOptions, Store
from tierstore.errors import ChecksumMismatch
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.migration.restore import restore, restore_checkpoint
from tierstore.tiers.tier import Tier


@pytest.fixture
def mirrored(tmp_path: Path) -> tuple[str, str, Manifest]:
    """Hot and cold tiers holding the same committed checkpoint of step 1."""
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest = saved(hot, 1)
    shutil.copytree(hot, cold)  # a local cold tier: the same layout, committed by its manifest
    return hot, cold, manifest


def hot_alone_loads(hot: str) -> bool:
    return matches(load(hot, options=ReaderOptions(lease=False))[0], 1)


DAMAGES = {
    "shard truncated": ("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[:100]), "size mismatch"),
    "shard flipped": ("__0_0.distcp", flip, "CRC32C mismatch"),
    "shard missing": ("__0_0.distcp", os.remove, "missing"),
    "metadata flipped": (".metadata", flip, "CRC32C mismatch"),
    "metadata missing": (".metadata", os.remove, "missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_restore_repairs_a_committed_hot_copy(mirrored, damage: str) -> None:
    hot, cold, manifest = mirrored
    file, harm, problem = DAMAGES[damage]
    harm(file_path(hot, manifest, file))
    assert restore(Store.of(hot, cold)) == manifest
    assert file_path(hot, manifest, file).read_bytes() == file_path(cold, manifest, file).read_bytes()
    assert hot_alone_loads(hot)

    harm(file_path(hot, manifest, file))
    report = restore_checkpoint(Store.of(hot, cold))
    assert [(r.path, problem in r.problem) for r in report.repaired] == [(file, True)]
    assert report.copied == (file,) and not report.manifest_repaired
    again = restore_checkpoint(Store.of(hot, cold))  # intact now: nothing copied
    assert again.copied == () and again.repaired == ()


def test_restore_replaces_a_torn_hot_manifest(mirrored) -> None:
    hot, cold, manifest = mirrored
    key = Path(hot, layout.manifest_key(manifest.name))
    key.write_bytes(key.read_bytes()[:50])
    flip(file_path(hot, manifest, "__0_0.distcp"))
    restore(Store.of(hot, cold))
    assert Tier("hot", hot).find_manifest(manifest.name) == manifest
    assert hot_alone_loads(hot)


def test_a_damaged_cold_copy_never_replaces_the_hot_file(mirrored) -> None:
    hot, cold, manifest = mirrored
    shard = file_path(hot, manifest, "__0_0.distcp")
    flip(shard)
    damaged = shard.read_bytes()
    file_path(cold, manifest, "__0_0.distcp").write_bytes(b"x" + damaged[1:])  # bad there too
    with pytest.raises(ChecksumMismatch, match=r"CRC32C mismatch: .* tier 'cold "):
        restore(Store.of(hot, cold))
    assert shard.read_bytes() == damaged  # no delete before a verified copy


def test_cli_restore_prints_what_it_repaired(mirrored) -> None:
    hot, cold, manifest = mirrored
    os.remove(file_path(hot, manifest, "__0_0.distcp"))
    proc = subprocess.run(
        [sys.executable, "-m", "tierstore", "restore", "--hot", hot, "--cold", cold],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"repaired  {manifest.name}  __0_0.distcp: missing" in proc.stdout
    assert "1 repaired" in proc.stdout
    assert hot_alone_loads(hot)
