"""Deleted data files kept for reuse (tierstore/storage/recycle.py): a new object overwrites
one in place, exactly, and never a file that someone still reads."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, collect_garbage, keep_last, prune
from tierstore.errors import UnsafePath
from tierstore.storage import local as local_mod
from tierstore.storage import recycle
from tierstore.storage.local import LocalBackend

MiB = 1 << 20


def _bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def _put(backend: LocalBackend, key: str, data: bytes) -> None:
    with backend.open_write(key) as out:
        out.write(data)


def _read(backend: LocalBackend, key: str) -> bytes:
    with backend.open_read(key) as f:
        return f.read()


def _ino(root: Path, key: str) -> int:
    return os.stat(root / key).st_ino


def _with_one_pooled(root: Path) -> LocalBackend:
    """A local tier at ``root`` whose pool holds one deleted 2 MiB file."""
    backend = LocalBackend(str(root))
    _put(backend, "x/a.bin", _bytes(2 * MiB, 1))
    backend.delete("x/a.bin")
    return backend


def _pooled(root: Path) -> list[str]:
    pool = root / recycle.DIR
    return sorted(os.listdir(pool)) if pool.exists() else []


@pytest.mark.parametrize("new_size", [3 * MiB, 2 * MiB, 5 * MiB + 17], ids=["same", "shorter", "longer"])
def test_a_new_object_overwrites_a_deleted_file_in_place_and_holds_exactly_its_bytes(
    tmp_path: Path, new_size: int
) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "a/old.bin", _bytes(3 * MiB, 1))
    old = _ino(tmp_path, "a/old.bin")
    backend.delete("a/old.bin")
    assert not (tmp_path / "a" / "old.bin").exists() and len(_pooled(tmp_path)) == 1
    data = _bytes(new_size, 2)
    _put(backend, "b/new.bin", data)
    assert _ino(tmp_path, "b/new.bin") == old  # the same file, its pages and blocks reused
    assert _read(backend, "b/new.bin") == data  # nothing of the old bytes past the new end
    assert backend.stat("b/new.bin").size == new_size
    assert _pooled(tmp_path) == []


def test_a_file_another_process_still_reads_is_never_overwritten(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    old = _bytes(4 * MiB, 3)
    _put(backend, "ckpt/shard.bin", old)
    path = tmp_path / "ckpt" / "shard.bin"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, hashlib
                f = open({str(path)!r}, "rb")
                print("open", flush=True)
                sys.stdin.readline()          # the file is deleted and a new object written
                sys.stdout.write(hashlib.sha256(f.read()).hexdigest())
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "open"
        held = path.stat().st_ino
        backend.delete("ckpt/shard.bin")
        new = _bytes(4 * MiB, 4)
        _put(backend, "next/shard.bin", new)
        assert _ino(tmp_path, "next/shard.bin") != held  # the lease was refused: a new file
        reader.stdin.write("go\n")
        reader.stdin.flush()
        digest = reader.stdout.read()
    finally:
        reader.kill()
        reader.wait()
    import hashlib

    assert digest == hashlib.sha256(old).hexdigest()  # the reader saw the old bytes, whole
    assert _read(backend, "next/shard.bin") == new
    assert _pooled(tmp_path) == []  # the held file was unlinked, not put back


def test_a_mapping_held_after_its_descriptor_closed_also_keeps_the_file(tmp_path: Path) -> None:
    import mmap

    backend = LocalBackend(str(tmp_path))
    old = _bytes(2 * MiB, 5)
    _put(backend, "c/x.bin", old)
    fd = os.open(tmp_path / "c" / "x.bin", os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    os.close(fd)
    try:
        backend.delete("c/x.bin")
        _put(backend, "d/y.bin", _bytes(2 * MiB, 6))
        assert mapping[:] == old
    finally:
        mapping.close()


def test_small_files_and_files_with_another_link_are_deleted_not_kept(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "m/manifest.json", b"{}" * 100)
    backend.delete("m/manifest.json")
    _put(backend, "m/big.bin", _bytes(2 * MiB, 7))
    os.link(tmp_path / "m" / "big.bin", tmp_path / "elsewhere.bin")
    backend.delete("m/big.bin")
    assert _pooled(tmp_path) == []
    _put(backend, "m/next.bin", _bytes(2 * MiB, 8))
    assert (tmp_path / "elsewhere.bin").read_bytes() == _bytes(2 * MiB, 7)


def test_the_pool_is_no_object_and_its_name_is_no_key(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "k/a.bin", _bytes(MiB, 9))
    _put(backend, "k/b.bin", _bytes(MiB, 10))
    backend.delete("k/a.bin")
    assert _pooled(tmp_path)
    assert [o.key for o in backend.list()] == ["k/b.bin"]
    for call in (
        lambda: backend.open_write(recycle.DIR + "/x"),
        lambda: backend.open_read(recycle.DIR + "/" + _pooled(tmp_path)[0]),
        lambda: backend.delete(recycle.DIR + "/" + _pooled(tmp_path)[0]),
        lambda: backend.list(recycle.DIR + "/"),
    ):
        with pytest.raises(UnsafePath):
            result = call()
            if not isinstance(result, (type(None), bytes)) and hasattr(result, "__next__"):
                list(result)


def test_the_cap_bounds_the_pool_and_zero_turns_it_off(tmp_path: Path) -> None:
    capped = LocalBackend(str(tmp_path / "capped"), recycle_bytes=3 * MiB)
    for i in range(4):
        _put(capped, f"x/{i}.bin", _bytes(2 * MiB, i))
    for i in range(4):
        capped.delete(f"x/{i}.bin")
    assert len(_pooled(tmp_path / "capped")) == 1  # a second 2 MiB file would pass 3 MiB
    off = LocalBackend(str(tmp_path / "off"), recycle_bytes=0)
    _put(off, "x/a.bin", _bytes(2 * MiB, 1))
    off.delete("x/a.bin")
    assert _pooled(tmp_path / "off") == []
    for bad in (-1, True, 1.5, "1G"):
        with pytest.raises(Exception, match="recycle_bytes"):
            LocalBackend(str(tmp_path), recycle_bytes=bad)


def test_pooled_bytes_count_as_free_space_and_gc_gives_them_back(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "store"))
    _put(backend, "x/a.bin", _bytes(8 * MiB, 1))
    backend.delete("x/a.bin")
    held = backend.recycle.held_bytes()
    assert held >= 8 * MiB
    st = os.statvfs(tmp_path)
    assert backend.free_bytes() - st.f_bavail * st.f_frsize >= held - MiB  # others write too
    collect_garbage(str(tmp_path / "store"), dry_run=True)
    assert _pooled(tmp_path / "store")
    collect_garbage(str(tmp_path / "store"), dry_run=False)
    assert _pooled(tmp_path / "store") == []


def test_a_full_disk_empties_the_pool_and_the_write_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalBackend(str(tmp_path), recycle_bytes=64 * MiB)
    for i in range(2):
        _put(backend, f"x/{i}.bin", _bytes(2 * MiB, i))
        backend.delete(f"x/{i}.bin")
    real_write = os.write
    calls = {"n": 0}

    def full_once(fd: int, data: object) -> int:  # the disk is full until the pool is emptied
        calls["n"] += 1
        if _pooled(tmp_path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(local_mod.os, "write", full_once)
    monkeypatch.setattr(recycle.RecyclePool, "take", lambda self, directory, name: None)
    data = _bytes(3 * MiB, 3)
    _put(backend, "y/new.bin", data)
    monkeypatch.undo()
    assert _read(backend, "y/new.bin") == data and _pooled(tmp_path) == []
    # and with nothing pooled, a full disk is the error it always was
    monkeypatch.setattr(
        local_mod.os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    with pytest.raises(Exception, match="(?i)space|full"):
        _put(backend, "y/other.bin", data)


def test_files_past_their_age_are_unlinked_when_the_pool_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _with_one_pooled(tmp_path)
    later = time.time() + recycle.MAX_AGE + 1
    monkeypatch.setattr(recycle.time, "time", lambda: later)
    _put(backend, "x/b.bin", _bytes(2 * MiB, 2))
    assert _pooled(tmp_path) == []


def test_only_filesystems_of_this_node_recycle(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "fs1@tcp:/lustre /lustre lustre rw 0 0\n"
        "server:/export /mnt/nfs nfs4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
    )
    kind = {
        p: recycle.filesystem_type(p, str(mounts))
        for p in ("/lustre/run1", "/mnt/nfs/x", "/dev/shm/x", "/home")
    }
    assert kind == {"/lustre/run1": "lustre", "/mnt/nfs/x": "nfs4", "/dev/shm/x": "tmpfs", "/home": "ext4"}
    assert {k for k, v in kind.items() if v in recycle.LOCAL_FILESYSTEMS} == {"/dev/shm/x", "/home"}


def test_a_filesystem_that_refuses_leases_turns_the_pool_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _with_one_pooled(tmp_path)
    real = fcntl.fcntl

    def no_leases(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETLEASE:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(recycle.fcntl, "fcntl", no_leases)
    data = _bytes(2 * MiB, 2)
    _put(backend, "x/b.bin", data)
    assert _read(backend, "x/b.bin") == data
    assert not backend.recycle.enabled
    _put(backend, "x/c.bin", _bytes(2 * MiB, 3))
    backend.delete("x/c.bin")
    assert _pooled(tmp_path) == []


def test_writers_of_two_processes_share_the_pool_and_every_object_is_exact(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    for i in range(6):
        _put(backend, f"old/{i}.bin", _bytes(MiB + i, i))
    for i in range(6):
        backend.delete(f"old/{i}.bin")
    assert len(_pooled(tmp_path)) == 6
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        from tierstore.storage.local import LocalBackend
        b = LocalBackend({str(tmp_path)!r})
        who = int(sys.argv[1])
        for i in range(5):
            with b.open_write(f"new/{{who}}-{{i}}.bin") as out:
                out.write(np.random.default_rng(100 * who + i).bytes(2 * (1 << 20) + i))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)]) for w in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for who in (1, 2):
        for i in range(5):
            assert _read(backend, f"new/{who}-{i}.bin") == _bytes(2 * MiB + i, 100 * who + i)
    assert _pooled(tmp_path) == []  # ten writes took the six files, and made four


def test_a_writer_killed_while_overwriting_a_recycled_file_leaves_only_a_temporary(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "old/a.bin", _bytes(64 * MiB, 1))
    backend.delete("old/a.bin")
    script = textwrap.dedent(
        f"""
        import sys
        from tierstore.storage.local import LocalBackend
        b = LocalBackend({str(tmp_path)!r})
        out = b.open_write("new/a.bin")
        out.write(b"\\x01" * (1 << 20))
        print("writing", flush=True)
        sys.stdin.readline()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [debris] = [o.key for o in backend.list()]  # the temporary, and no object under the key
    assert debris.startswith("new/.a.bin.tmp-") and backend.stat(debris).size == 64 * MiB
    with pytest.raises(FileNotFoundError):
        backend.open_read("new/a.bin")
    report = collect_garbage(str(tmp_path), grace=0, dry_run=False)
    assert debris in {g.key for g in report.garbage} and list(backend.list()) == []


def test_a_run_that_keeps_two_checkpoints_writes_each_save_into_the_pruned_ones_files(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    states = []
    pruned_inodes: set[int] = set()
    for step in range(5):
        state = {"w": torch.randn(1 << 20), "b": torch.randn(300_000), "step": torch.tensor(step)}
        states.append({k: v.clone() for k, v in state.items()})
        dcp.save(state, storage_writer=TieredWriter(hot=str(hot), step=step), no_dist=True)
        inodes = {p.stat().st_ino for p in hot.rglob("*.distcp")}
        if step >= 3:
            assert inodes & pruned_inodes, "the save took new files while the pruned ones waited"
        before = {p.stat().st_ino for p in hot.rglob("*.distcp")}
        prune(str(hot), hot_policy=keep_last(2))
        pruned_inodes = before - {p.stat().st_ino for p in hot.rglob("*.distcp")}
    for step in (3, 4):
        into = {"w": torch.zeros(1 << 20), "b": torch.zeros(300_000), "step": torch.tensor(-1)}
        dcp.load(into, storage_reader=TieredReader(hot=str(hot), step=step), no_dist=True)
        assert all(torch.equal(into[k], states[step][k]) for k in into)


def test_a_file_planted_in_the_pool_is_never_written_through(tmp_path: Path) -> None:
    store, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    backend = LocalBackend(str(store))
    _put(backend, "x/a.bin", _bytes(2 * MiB, 1))
    backend.delete("x/a.bin")  # the pool exists now
    pool = store / recycle.DIR
    for name in os.listdir(pool):
        os.unlink(pool / name)
    precious = outside / "precious.bin"
    precious.write_bytes(_bytes(2 * MiB, 2))
    os.link(precious, pool / "0-linked")  # another name of a file outside the store
    target = outside / "target.bin"
    target.write_bytes(_bytes(2 * MiB, 3))
    os.symlink(target, pool / "1-symlink")
    data = _bytes(2 * MiB, 4)
    _put(backend, "y/new.bin", data)
    assert _read(backend, "y/new.bin") == data
    assert precious.read_bytes() == _bytes(2 * MiB, 2) and target.read_bytes() == _bytes(2 * MiB, 3)
    assert _ino(store, "y/new.bin") not in (precious.stat().st_ino, target.stat().st_ino)


def test_a_recycled_file_rewritten_within_one_clock_tick_still_gets_a_new_version(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDWR)
    try:
        then = os.fstat(fd).st_mtime_ns
        recycle.fresh_mtime(fd, then)  # a coarse clock: the rewrite kept the old mtime
        assert os.fstat(fd).st_mtime_ns == then + 1
        os.utime(fd, ns=(then, then + 500))
        recycle.fresh_mtime(fd, then)  # the clock moved: nothing to do
        assert os.fstat(fd).st_mtime_ns == then + 500
    finally:
        os.close(fd)


def test_the_writer_of_a_recycled_file_makes_its_version_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "k/a.bin", _bytes(2 * MiB, 1))
    old = backend.stat("k/a.bin")
    backend.delete("k/a.bin")
    [pooled] = _pooled(tmp_path)
    deleted_mtime = os.stat(tmp_path / recycle.DIR / pooled).st_mtime_ns
    seen: list[int] = []
    real = recycle.fresh_mtime
    monkeypatch.setattr(local_mod, "fresh_mtime", lambda fd, ns: (seen.append(ns), real(fd, ns))[1])
    _put(backend, "k/a.bin", _bytes(2 * MiB, 2))
    assert seen == [deleted_mtime]  # the writer compared the new mtime with the old one
    assert backend.stat("k/a.bin").version != old.version


def test_a_disk_with_less_free_than_the_pool_holds_gets_the_pool_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalBackend(str(tmp_path))
    _put(backend, "x/a.bin", _bytes(4 * MiB, 1))
    backend.delete("x/a.bin")
    assert _pooled(tmp_path)
    real = os.statvfs
    tight = {"on": True}

    def statvfs(path: str) -> os.statvfs_result:
        st = real(path)
        if not tight["on"]:
            return st
        tight["on"] = False  # after the drain the disk has its space back
        fields = list(st)
        fields[4] = 1  # f_bavail: one block free
        return os.statvfs_result(fields)

    monkeypatch.setattr(local_mod.os, "statvfs", statvfs)
    free = backend.free_bytes()
    assert _pooled(tmp_path) == []
    st = real(str(tmp_path))
    assert abs(free - st.f_bavail * st.f_frsize) < 64 * MiB  # the disk's own free, no pool added
