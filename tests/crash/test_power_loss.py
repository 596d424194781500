"""Power loss on the local tier: at a crash, every write not fsynced and every directory
entry not made durable by a directory fsync is lost. The fsync order of design.md
invariant 2 must leave every listed checkpoint loadable and every returned save committed
at every point of the syscall log, and removing any one fsync must break that."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import model
import pytest
import torch.distributed.checkpoint as dcp
from stats import STATS

import tierstore.storage.local as local_module
import tierstore.storage.local_writer as local_writer_module
from tierstore import TieredWriter, list_checkpoints
from tierstore.format import layout


@dataclass
class _Node:
    is_dir: bool
    data: bytearray = field(default_factory=bytearray)  # files: what was written
    durable: bytes = b""  # files: as of the last fsync
    entries: dict[str, int] = field(default_factory=dict)  # dirs: name -> node id
    durable_entries: dict[str, int] = field(default_factory=dict)  # dirs: as of the last fsync


class ShadowFS:
    """Mirrors the local backend's syscalls below ``root`` into a model of what is durable.

    ``drop`` names fsync call sites to ignore, as if the code did not make them:
    ``"file"`` (a data file's fsync), ``"data-dir"`` (its directory's), ``"publish-temp"``,
    ``"publish-dir"``, ``"mkdir"``.
    """

    def __init__(self, root: str, drop: frozenset[str] = frozenset()) -> None:
        self.root = os.path.realpath(root)
        self.drop = drop
        self.nodes: dict[int, _Node] = {0: _Node(is_dir=True)}
        self.fds: dict[int, int] = {}  # fd -> node id
        self.log: list[tuple[str, dict[int, _Node]]] = []  # (op, snapshot) after each op
        self.marks: dict[int, list[str]] = {}  # log length -> events (saves returned)

    # -- the model --------------------------------------------------------------------------

    def _parts(self, path: str) -> list[str] | None:
        real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if real != self.root and not real.startswith(self.root + os.sep):
            return None
        rel = os.path.relpath(real, self.root)
        return [] if rel == "." else rel.split(os.sep)

    def _lookup(self, parts: list[str]) -> int | None:
        node = 0
        for part in parts:
            child = self.nodes[node].entries.get(part)
            if child is None:
                return None
            node = child
        return node

    def _parent(self, path: str, dir_fd: int | None = None) -> tuple[int, str] | None:
        if dir_fd is not None:  # the backend walks directory fds: resolve from that node
            node: int | None = self.fds.get(dir_fd)
            *dirs, name = path.split("/")
            for part in dirs:
                node = None if node is None else self.nodes[node].entries.get(part)
            return None if node is None else (node, name)
        parts = self._parts(path)
        if not parts:
            return None
        parent = self._lookup(parts[:-1])
        return None if parent is None else (parent, parts[-1])

    def _node(self, path: str, dir_fd: int | None) -> int | None:
        if dir_fd is None and self._parts(path) == []:
            return 0
        where = self._parent(path, dir_fd)
        return None if where is None else self.nodes[where[0]].entries.get(where[1])

    def _new(self, path: str, is_dir: bool, dir_fd: int | None = None) -> int | None:
        where = self._parent(path, dir_fd)
        if where is None:
            return None
        node = max(self.nodes) + 1
        self.nodes[node] = _Node(is_dir=is_dir)
        self.nodes[where[0]].entries[where[1]] = node
        return node

    def _record(self, op: str) -> None:
        snapshot = {
            k: _Node(n.is_dir, bytearray(), n.durable, {}, dict(n.durable_entries))
            for k, n in self.nodes.items()
        }
        self.log.append((op, snapshot))

    def _site(self) -> str:
        frame = sys._getframe(2)
        name = frame.f_code.co_name
        if name == "fsync_dir":
            caller = frame.f_back.f_code.co_name if frame.f_back else ""
            return {
                "_commit": "data-dir",
                "sync_dirs": "data-dir",
                "publish": "publish-dir",
                "_makedirs": "mkdir",
            }.get(caller, caller)
        return {"_commit": "file", "publish": "publish-temp"}.get(name, name)

    # -- the syscalls ----------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        if flags & os.O_CREAT:
            node = self._new(path, is_dir=False, dir_fd=dir_fd)
        else:
            node = self._node(path, dir_fd)
        if node is not None:
            self.fds[fd] = node
            if flags & os.O_CREAT:
                self._record(f"create {path}")
        return fd

    def write(self, fd: int, data: Any) -> int:
        n = os.write(fd, data)
        if fd in self.fds:
            self.nodes[self.fds[fd]].data += bytes(memoryview(data)[:n])
            self._record(f"write {n}")
        return n

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        node = self.nodes.get(self.fds.get(fd, -1))
        if node is None or self._site() in self.drop:
            return
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable = bytes(node.data)
        self._record("fsync")

    def close(self, fd: int) -> None:
        os.close(fd)
        self.fds.pop(fd, None)

    def mkdir(self, path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        os.mkdir(path, mode, dir_fd=dir_fd)
        if self._new(path, is_dir=True, dir_fd=dir_fd) is not None:
            self._record(f"mkdir {path}")

    def link(
        self,
        src: str,
        dst: str,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
        node, where = self._node(src, src_dir_fd), self._parent(dst, dst_dir_fd)
        if node is not None and where is not None:
            self.nodes[where[0]].entries[where[1]] = node
            self._record(f"link {dst}")

    def rename(
        self, src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        old, new = self._parent(src, src_dir_fd), self._parent(dst, dst_dir_fd)
        if old is not None and new is not None:
            node = self.nodes[old[0]].entries.pop(old[1])
            self.nodes[new[0]].entries[new[1]] = node
            self._record(f"rename {dst}")

    replace = rename  # the model is the same: the destination entry now names the node

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        os.unlink(path, dir_fd=dir_fd)
        where = self._parent(path, dir_fd)
        if where is not None:
            self.nodes[where[0]].entries.pop(where[1], None)
            self._record(f"unlink {path}")

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        os.rmdir(path, dir_fd=dir_fd)
        where = self._parent(path, dir_fd)
        if where is not None:
            self.nodes[where[0]].entries.pop(where[1], None)
            self._record(f"rmdir {path}")

    def __getattr__(self, name: str) -> Any:  # everything else: the real os module
        return getattr(os, name)

    # -- the crash --------------------------------------------------------------------------

    @staticmethod
    def materialize(snapshot: dict[int, _Node], target: str) -> None:
        """Write the tree that survives a power loss at this snapshot under ``target``."""

        def build(node_id: int, path: str) -> None:
            os.makedirs(path, exist_ok=True)
            for name, child in snapshot[node_id].durable_entries.items():
                node = snapshot[child]
                if node.is_dir:
                    build(child, os.path.join(path, name))
                else:
                    with open(os.path.join(path, name), "wb") as f:
                        f.write(node.durable)

        build(0, target)


@contextmanager
def recording(root: str, drop: frozenset[str] = frozenset()) -> Iterator[ShadowFS]:
    shadow = ShadowFS(root, drop)
    modules = (local_module, local_writer_module)  # every module of the local backend's syscalls
    for module in modules:
        module.os = shadow  # type: ignore[assignment]
    try:
        yield shadow
    finally:
        for module in modules:
            module.os = os  # type: ignore[assignment]


def violations_after_power_loss(tmp_path: Path, drop: frozenset[str] = frozenset()) -> list[str]:
    """Two saves under the recorder, then every crash point's surviving tree is checked."""
    hot = tmp_path / "hot"
    hot.mkdir()
    with recording(str(hot), drop) as shadow:
        for step in (1, 2):
            dcp.save(model.state_for(step), storage_writer=TieredWriter(str(hot), step=step))
            shadow.marks.setdefault(len(shadow.log), []).append(layout.default_name(step))
    found: list[str] = []
    returned: set[str] = set()
    for index, (op, snapshot) in enumerate(shadow.log, start=1):
        returned |= set(shadow.marks.get(index, []))
        image = tmp_path / f"after-{index}"
        ShadowFS.materialize(snapshot, str(image))
        listed = {c.name: c for c in list_checkpoints(str(image))}
        for name in sorted(returned - set(listed)):
            found.append(f"after op {index} ({op}): save of {name} returned but is not committed")
        for name, info in listed.items():
            try:
                target, _ = model.load(str(image), None, name)
                ok = model.matches(target, info.step)
            except BaseException as err:
                ok, name = False, f"{name} ({type(model.unwrap(err)).__name__})"
            if not ok:
                found.append(f"after op {index} ({op}): listed {name} does not load")
        shutil.rmtree(image)
    STATS.steps += len(shadow.log)
    STATS.crash_points.update(f"power-loss after {op.split()[0]}" for op, _ in shadow.log)
    return found


def test_every_power_loss_point_is_safe(tmp_path: Path) -> None:
    found = violations_after_power_loss(tmp_path)
    assert found == [], found


@pytest.mark.parametrize("drop", ["file", "data-dir", "publish-temp", "publish-dir", "mkdir"])
def test_removing_any_fsync_is_caught(tmp_path: Path, drop: str) -> None:
    found = violations_after_power_loss(tmp_path, frozenset({drop}))
    STATS.faults += 1
    assert found, f"dropping the {drop} fsync went unnoticed"
