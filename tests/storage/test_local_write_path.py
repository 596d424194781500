"""The local write path (issue 14 item 4): buffers written without a copy, directory fsyncs
batched per call of ``sync_dirs`` instead of one per file, and optional O_DIRECT that falls
back cleanly where the filesystem refuses it."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore.storage.backend import crc32c_update
from tierstore.storage.local import LocalBackend

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _pattern(size: int, seed: int = 1) -> bytearray:
    return bytearray(np.random.default_rng(seed).bytes(size))


# -- no copies -------------------------------------------------------------------------------


def _buffer(kind: str, size: int) -> memoryview:
    if kind == "tensor":  # a tensor's bytes, as the raw encoding writes them
        return memoryview(torch.arange(size // 4, dtype=torch.float32).view(torch.uint8).numpy())
    if kind == "numpy":
        return memoryview(np.frombuffer(_pattern(size, seed=2), dtype=np.float64).reshape(-1, 1024))
    return memoryview(_pattern(size))


@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("kind", ["bytearray", "numpy", "tensor"])
def test_a_64_mib_buffer_is_written_without_a_python_copy(tmp_path: Path, kind: str, direct_io: bool) -> None:
    data = _buffer(kind, 64 * MiB)
    backend = LocalBackend(str(tmp_path), direct_io=direct_io)
    tracemalloc.start()
    try:
        with backend.open_write("big/obj", defer_dir_sync=True) as out:
            out.write(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"writing 64 MiB allocated {peak} bytes in Python"
    stored = (tmp_path / "big" / "obj").read_bytes()
    assert stored == data.tobytes()
    assert out.size == 64 * MiB and out.crc32c == crc32c_update(0, stored)


# -- directory fsyncs -------------------------------------------------------------------------


@pytest.fixture
def dir_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(device, inode) of every directory the real ``os.fsync`` was called on."""
    synced: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_deferred_writes_fsync_each_directory_once_in_sync_dirs(
    tmp_path: Path, dir_fsyncs: list[tuple[int, int]]
) -> None:
    backend = LocalBackend(str(tmp_path / "root"))
    backend.publish("ck/marker", b"m")  # the directory exists: what follows makes none
    keys = [f"ck/{rank}/{i}.distcp" for rank in ("r0", "r1") for i in range(5)]
    (tmp_path / "root" / "ck" / "r0").mkdir()
    (tmp_path / "root" / "ck" / "r1").mkdir()
    dir_fsyncs.clear()
    for key in keys:
        with backend.open_write(key, defer_dir_sync=True) as out:
            out.write(key.encode())
    assert dir_fsyncs == []  # closed, readable, but no directory fsync yet
    assert {i.key for i in backend.list("ck/")} == {*keys, "ck/marker"}
    backend.sync_dirs(keys + ["ck/r0/never-written", "gone/dir/key"])
    assert sorted(dir_fsyncs) == sorted(_identity(tmp_path / "root" / "ck" / r) for r in ("r0", "r1"))


def test_without_deferring_every_close_fsyncs_its_directory(
    tmp_path: Path, dir_fsyncs: list[tuple[int, int]]
) -> None:
    backend = LocalBackend(str(tmp_path))
    backend.publish("ck/marker", b"m")
    dir_fsyncs.clear()
    for i in range(3):
        with backend.open_write(f"ck/{i}") as out:
            out.write(b"x")
    assert dir_fsyncs == [_identity(tmp_path / "ck")] * 3


def test_directories_a_deferred_write_creates_are_made_durable_at_once(
    tmp_path: Path, dir_fsyncs: list[tuple[int, int]]
) -> None:
    # A new directory's entry lives in its parent: that fsync is not deferred (one per
    # directory made, not per file), so sync_dirs only owes the files' own directories.
    backend = LocalBackend(str(tmp_path / "root"))
    backend.publish("marker", b"m")
    dir_fsyncs.clear()
    with backend.open_write("new/deeper/file", defer_dir_sync=True) as out:
        out.write(b"x")
    root = tmp_path / "root"
    assert dir_fsyncs == [_identity(root), _identity(root / "new")]
    backend.sync_dirs(["new/deeper/file"])
    assert dir_fsyncs[2:] == [_identity(root / "new" / "deeper")]


def test_sync_dirs_refuses_a_link_planted_as_a_directory(tmp_path: Path) -> None:
    from tierstore.errors import UnsafePath

    backend = LocalBackend(str(tmp_path / "root"))
    backend.publish("marker", b"m")
    os.symlink(tmp_path, tmp_path / "root" / "ck")
    with pytest.raises(UnsafePath):
        backend.sync_dirs(["ck/file"])


def test_a_plugin_open_write_without_the_keyword_still_works(tmp_path: Path) -> None:
    from tierstore.storage.backend import ObjectWriter

    class OldPlugin(LocalBackend):  # written before defer_dir_sync existed
        def open_write(self, key: str) -> ObjectWriter:  # type: ignore[override]
            return super().open_write(key)

    backend = OldPlugin(str(tmp_path))
    with backend.open_write("k", defer_dir_sync=True) as out:
        out.write(b"old")
    backend.sync_dirs(["k"])
    assert backend.read_bytes("k") == b"old"


# -- O_DIRECT ---------------------------------------------------------------------------------


def _open_flags_of_temporaries(directory: Path) -> list[int]:
    """Open-file flags of this process's descriptors on write temporaries in ``directory``."""
    flags = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.dirname(target) == str(directory) and ".tmp-" in target:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                fields = dict(line.split(":", 1) for line in info if ":" in line)
            flags.append(int(fields["flags"], 8))
    return flags


def _write_unaligned(backend: LocalBackend, key: str, data: bytes) -> int:
    """Write ``data`` in pieces that respect no alignment; return its CRC32C."""
    sizes = [1, 4095, 3 * MiB + 17, 100, 9 * MiB, 12_345]
    with backend.open_write(key) as out:
        view, i = memoryview(data), 0
        while view:
            out.write(view[: sizes[i % len(sizes)]])
            view, i = view[sizes[i % len(sizes)] :], i + 1
    return out.crc32c


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_direct_io_writes_bypass_the_cache_and_store_the_same_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = bytes(_pattern(21 * MiB + 333))
    backend = LocalBackend(str(tmp_path), direct_io=True)
    with backend.open_write("d/probe") as probe:
        probe.write(b"x")
        flags = _open_flags_of_temporaries(tmp_path / "d")
    if flags != [flags[0] | O_DIRECT] or "refuses O_DIRECT" in caplog.text:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    crc = _write_unaligned(backend, "d/obj", data)
    assert (tmp_path / "d" / "obj").read_bytes() == data
    assert crc == crc32c_update(0, data)
    assert sorted(os.listdir(tmp_path / "d")) == ["obj", "probe"]


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A real ramfs, which refuses O_DIRECT, where this machine lets us mount one."""
    mount = tmp_path / "ram"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def dev_shm() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        yield Path(directory)


@pytest.mark.parametrize("where", ["ramfs", "dev_shm"])
def test_direct_io_falls_back_where_refused_and_says_so_once(
    where: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    root: Path = request.getfixturevalue(where)
    backend = LocalBackend(str(root), direct_io=True)
    files = {f"k/{i}": bytes(_pattern(5 * MiB + 7 * i, seed=i)) for i in range(3)}
    with caplog.at_level(logging.WARNING, logger="tierstore.storage.local"):
        for key, data in files.items():
            assert _write_unaligned(backend, key, data) == crc32c_update(0, data)
    for key, data in files.items():
        assert (root / key).read_bytes() == data
    assert sorted(os.listdir(root / "k")) == ["0", "1", "2"]  # no temporary left by the refusal
    refusals = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    if where == "ramfs":  # tmpfs takes O_DIRECT since Linux 6.6; ramfs never does
        assert len(refusals) == 1 and str(root) in refusals[0].getMessage()
    else:
        assert len(refusals) <= 1
