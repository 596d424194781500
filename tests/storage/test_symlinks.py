"""No write, publish, mkdir or delete follows a symbolic link out of a local store (issue 12,
item 3). Each test plants a link below the root to an ``outside`` directory holding files,
runs one operation, and checks ``outside`` is exactly as it was."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from tierstore.errors import UnsafePath
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.prune import prune_tier
from tierstore.lifecycle.retention import keep_last
from tierstore.storage.backend import crc32c_update
from tierstore.storage.local import LocalBackend
from tierstore.tiers.leases import take
from tierstore.tiers.tier import Tier

VICTIMS = {"__0_0.distcp": b"outside the store" * 64, ".metadata": b"not ours"}


def snapshot(path: Path) -> dict[str, str]:
    """Every entry below ``path``: kind and, for files, a hash of the bytes."""
    found = {}
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, path)
            found[rel] = "dir" if name in dirs else hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    victim = tmp_path / "outside"
    (victim / "sub").mkdir(parents=True)
    for name, data in VICTIMS.items():
        (victim / name).write_bytes(data)
        (victim / "sub" / name).write_bytes(data)
    return victim


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    backend = LocalBackend(str(tmp_path / "root"))
    backend.label = "hot test-root"
    return backend


def refused(err: pytest.ExceptionInfo[UnsafePath], key: str) -> None:
    assert err.value.key == key
    assert key in str(err.value) and "hot test-root" in str(err.value)


def save(tier: Tier, step: int) -> Manifest:
    name, attempt = layout.default_name(step), layout.new_attempt()
    files = []
    for path, data in VICTIMS.items():
        tier.backend.publish(tier.file_key(name, attempt, path), data)
        files.append(FileEntry(path, len(data), crc32c_update(0, data), 0))
    manifest = Manifest(
        name=name, step=step, attempt=attempt, world_size=1, created=time.time() + step, files=tuple(files)
    )
    tier.publish_manifest(manifest)
    return manifest


def test_prune_through_a_symlinked_attempt_directory_deletes_nothing_outside(
    tmp_path: Path, outside: Path
) -> None:
    # A forged store: the manifest of step 1 names an attempt directory that is a link to
    # a directory holding files of the very names the manifest lists.
    tier = Tier("hot", str(tmp_path / "root"))
    old, _ = save(tier, 1), save(tier, 2)
    attempt_dir = tmp_path / "root" / layout.attempt_prefix(old.name, old.attempt)
    for name in VICTIMS:
        (attempt_dir / name).unlink()
    attempt_dir.rmdir()
    os.symlink(outside, attempt_dir)
    before = snapshot(outside)
    try:
        prune_tier(tier, keep_last(1))
    except UnsafePath as err:  # refusing is fine; following the link is not
        assert old.attempt in str(err) and tier.label in str(err)
    assert snapshot(outside) == before


def test_lease_through_a_symlinked_leases_directory_is_refused(
    tmp_path: Path, backend: LocalBackend, outside: Path
) -> None:
    os.makedirs(backend.root)
    os.symlink(outside, os.path.join(backend.root, layout.LEASE_DIR))
    before = snapshot(outside)
    key = layout.lease_key("step-1", "abc")
    with pytest.raises(UnsafePath) as err:
        backend.publish(key, b"{}")
    refused(err, key)
    assert take(Tier("hot", backend.root), "step-1") is None  # logged, not raised
    assert snapshot(outside) == before


def test_publish_through_a_symlinked_manifests_directory_is_refused(
    backend: LocalBackend, outside: Path
) -> None:
    os.makedirs(backend.root)
    os.symlink(outside, os.path.join(backend.root, layout.MANIFEST_DIR))
    before = snapshot(outside)
    with pytest.raises(UnsafePath) as err:
        backend.publish("manifests/step-1.json", b"{}")
    refused(err, "manifests/step-1.json")
    with pytest.raises(UnsafePath):
        backend.open_write("manifests/new/dir/x")  # no mkdir through the link either
    assert snapshot(outside) == before


def test_delete_through_a_symlinked_directory_is_refused_and_removes_no_directory(
    backend: LocalBackend, outside: Path
) -> None:
    # The old delete unlinked outside/sub/__0_0.distcp, then pruned outside/sub once empty.
    os.makedirs(backend.root)
    os.symlink(outside, os.path.join(backend.root, "ck"))
    (outside / "sub" / ".metadata").unlink()
    before = snapshot(outside)
    with pytest.raises(UnsafePath) as err:
        backend.delete("ck/sub/__0_0.distcp")
    refused(err, "ck/sub/__0_0.distcp")
    assert snapshot(outside) == before


def test_delete_of_a_link_removes_the_link_not_its_target(backend: LocalBackend, outside: Path) -> None:
    backend.publish("ck/real", b"ok")
    os.symlink(outside / ".metadata", os.path.join(backend.root, "ck", "link"))
    before = snapshot(outside)
    backend.delete("ck/link")
    assert not os.path.lexists(os.path.join(backend.root, "ck", "link"))
    assert snapshot(outside) == before


def test_a_link_swapped_in_during_a_write_cannot_redirect_it(backend: LocalBackend, outside: Path) -> None:
    # Time of check to time of use: the directory was real when the write began.
    for finish in ("close", "abort"):
        out = backend.open_write(f"d/{finish}/__0_0.distcp")
        out.write(b"new bytes")
        real = os.path.join(backend.root, "d", finish)
        os.rename(real, real + ".moved")
        os.symlink(outside, real)
        before = snapshot(outside)
        getattr(out, finish)()
        assert snapshot(outside) == before
        moved = os.listdir(real + ".moved")
        assert moved == (["__0_0.distcp"] if finish == "close" else [])


def test_list_and_stat_never_look_through_links(backend: LocalBackend, outside: Path) -> None:
    backend.publish("ck/real", b"ok")
    os.symlink(outside, os.path.join(backend.root, "ck", "dirlink"))
    os.symlink(outside / ".metadata", os.path.join(backend.root, "ck", "filelink"))
    os.mkfifo(os.path.join(backend.root, "ck", "fifo"))
    os.symlink(outside, os.path.join(backend.root, "top"))
    assert [i.key for i in backend.list("")] == ["ck/real"]
    assert [i.key for i in backend.list("ck/")] == ["ck/real"]
    assert list(backend.list("top/")) == []
    assert list(backend.list("ck/dirlink/")) == []
    with pytest.raises(UnsafePath) as err:
        backend.stat("top/.metadata")
    refused(err, "top/.metadata")
