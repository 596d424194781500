"""A local tier's delete gives the space back and leaves the deleted bytes to whoever holds
them (docs/design.md invariant 24): a prune, ``gc --yes`` and a ``direct_io`` tier's deletes
free what they delete, another job on the same disk can use it, and nothing a later write does
lands in a deleted file, not even one held by a descriptor a write lease cannot see."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter, collect_garbage, keep_last, prune
from tierstore.format import layout
from tierstore.storage.local import LocalBackend

MiB = 1 << 20


def _bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def _put(backend: LocalBackend, key: str, data: bytes) -> None:
    with backend.open_write(key) as out:
        out.write(data)


def _du(root: Path) -> int:
    """What ``du`` counts below ``root``: the blocks of every file, hidden ones too."""
    return sum(
        os.lstat(os.path.join(where, name)).st_blocks * 512
        for where, _, names in os.walk(root)
        for name in names
    )


def _state(step: int, size: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size // 4,), float(step)), "step": torch.tensor(step)}


def _save_and_prune(hot: Path, steps: range, size: int, keep: int = 1) -> None:
    """A run that keeps its newest ``keep`` checkpoints: save, then prune the older ones."""
    for step in steps:
        dcp.save(_state(step, size), storage_writer=TieredWriter(hot=str(hot), step=step), no_dist=True)
        prune(str(hot), hot_policy=keep_last(keep))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs of this test's own: its free space changes only with what the test does."""
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_prune_gives_the_pruned_checkpoints_space_back(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    _save_and_prune(hot, range(4), 4 * MiB)
    assert [p.name for p in hot.iterdir() if p.name.startswith(".")] == []  # nothing kept aside
    assert _du(hot) < 5 * MiB  # the one checkpoint kept, nothing of the three pruned


def test_on_a_filesystem_of_its_own_a_prune_shows_as_free_space(small_fs: Path) -> None:
    def used() -> int:  # what `df` says is used
        st = os.statvfs(small_fs)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    hot = small_fs / "hot"
    _save_and_prune(hot, range(1), 4 * MiB)
    one = used()
    _save_and_prune(hot, range(1, 4), 4 * MiB)
    assert used() <= one + MiB // 2  # one checkpoint on the disk, as after the first save
    st = os.statvfs(small_fs)
    assert LocalBackend(str(hot)).free_bytes() == st.f_bavail * st.f_frsize  # `tierstore du`'s free


def test_a_second_root_on_the_same_small_filesystem_saves_after_the_first_job_ended(small_fs: Path) -> None:
    # Each job keeps two 4 MiB checkpoints and writes a third before it prunes: the first job,
    # ended, holds 8 MiB; the second needs 12 MiB and a margin of the 16 left, so nothing else
    # of the first job's (what it deleted) may stay on the disk.
    _save_and_prune(small_fs / "job1", range(5), 4 * MiB, keep=2)
    _save_and_prune(small_fs / "job2", range(5), 4 * MiB, keep=2)
    assert _du(small_fs / "job1") < 9 * MiB and _du(small_fs / "job2") < 9 * MiB


def test_gc_yes_leaves_no_byte_of_what_it_deleted(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    dcp.save(_state(0, 8 * MiB), storage_writer=TieredWriter(hot=str(hot), step=0), no_dist=True)
    backend = LocalBackend(str(hot))
    for info in list(backend.list("")):
        if layout.kind_of(info.key) is layout.KeyKind.MANIFEST:
            backend.delete(info.key)  # the attempt's data is named by no manifest now: garbage
    before = _du(hot)
    report = collect_garbage(str(hot), grace=0, dry_run=False)
    assert report.bytes >= 8 * MiB and not report.failures
    assert before - _du(hot) >= 8 * MiB  # what it said it deleted is off the disk
    assert _du(hot) < MiB


def test_direct_io_deletes_give_their_space_back(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "hot"), direct_io=True)
    for i in range(8):
        _put(backend, f"c{i}/data.bin", _bytes(4 * MiB, i))
        if i:
            backend.delete(f"c{i - 1}/data.bin")
    assert _du(tmp_path / "hot") < 5 * MiB  # one object of 4 MiB, not eight saves' worth


@pytest.mark.parametrize("hold", ["descriptor", "mapping", "o_path"])
def test_a_deleted_file_someone_holds_keeps_its_bytes_whatever_is_written_next(
    tmp_path: Path, hold: str
) -> None:
    import mmap

    backend = LocalBackend(str(tmp_path / "hot"))
    old = _bytes(4 * MiB, 1)
    _put(backend, "ckpt/0/data.bin", old)
    path = tmp_path / "hot" / "ckpt" / "0" / "data.bin"
    fd = os.open(path, os.O_PATH if hold == "o_path" else os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if hold == "mapping" else None
    try:
        backend.delete("ckpt/0/data.bin")
        for i in range(3):  # the next saves, the same size
            _put(backend, f"ckpt/{i + 1}/data.bin", _bytes(4 * MiB, 2 + i))
        if mapping is not None:
            seen = mapping[:]
        else:
            # What an O_PATH holder can do at any time: open the file again through its descriptor
            # (a write lease never sees an O_PATH descriptor, so it cannot protect this).
            with open(f"/proc/self/fd/{fd}", "rb") as again:
                seen = again.read()
        assert seen == old
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)
