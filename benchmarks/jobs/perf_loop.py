"""Saves and loads the way a training loop runs them:
``python -m benchmarks.jobs.perf_loop SPEC.json OUT.json``.

One process on tmpfs (``/dev/shm``: no device behind the page cache, so only CPU work
differs), the state of ``perf_common.make_state``. Every rep is one "step" of a loop:

1. touch the state as an optimizer step would (every float tensor updated in place);
2. save it three ways, in an order rotated every rep: DCP's ``FileSystemWriter``,
   ``TieredWriter`` (raw encoding, its defaults), and the **floor**: the same bytes written
   by one ``os.write`` loop into one file (fsynced, as both writers fsync) plus one CRC32C
   pass over them, the least a verified save can do; the floor overwrites the file of the
   checkpoint it retired, so it never waits for new pages;
3. load each back into tensors allocated once before the loop (rotated too):
   ``FileSystemReader``, ``TieredReader``, and the load floor: ``readinto`` the same tensors
   plus one CRC32C pass; and DCP alone (``dcp_null``): ``dcp.load`` of FileSystemWriter's
   checkpoint through a reader that reads its metadata and no data, DCP's own share of a load;
4. keep the newest two checkpoints of each writer, as a run with ``keep_last(2)`` does: the
   older ones are deleted (``tierstore.prune`` for ``TieredWriter``'s).

The first ``KEEP + 1`` reps are the run's start, while its checkpoints still grow to the
number kept: recorded as warm-up (negative reps), left out of the spread.

Each operation is timed in wall seconds and in user and system CPU seconds of the process
(every thread), with the pages the kernel allocated and, on a VM with free page reporting
(``virtio_balloon``), the memory it handed back to the host meanwhile. A last phase writes
the same bytes into page-cache pages that are reused (the file rewritten) and into pages
that are new (a file kept per write): the cost that separates them is the machine's, not a
writer's (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import Record
from benchmarks.jobs.perf_common import TMPFS, blank_like, make_state, nbytes
from benchmarks.jobs.perf_io import NullReader
from tierstore import TieredReader, TieredWriter, keep_last, prune

warnings.filterwarnings("ignore")
SAVES = ("fsw", "tiered", "floor")
LOADS = ("fsr", "tiered", "floor", "dcp_null")
KEEP = 2
CHUNK = 4 << 20  # the floor's write size, the hot tier's too
_REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def tensors(state: dict[str, Any]) -> Iterator[torch.Tensor]:
    for key in sorted(state):
        if isinstance(state[key], torch.Tensor):
            yield state[key]


def as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def step(state: dict[str, Any]) -> None:
    """What an optimizer step does to the state's memory: every float updated in place."""
    with torch.no_grad():
        for tensor in tensors(state):
            if tensor.is_floating_point() and tensor.dim():
                tensor.mul_(0.999).add_(1e-4)


def floor_save(state: dict[str, Any], path: Path, *, truncate: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o644)
    try:
        for tensor in tensors(state):
            view = as_bytes(tensor)
            crc32c.crc32c(view)
            for start in range(0, len(view), CHUNK):
                chunk = view[start : start + CHUNK]
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
        os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def floor_load(state: dict[str, Any], path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        for tensor in tensors(state):
            view = as_bytes(tensor)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise EOFError(f"{path}: short by {len(view) - got} bytes")
                got += n
            crc32c.crc32c(view)


def vmstat() -> dict[str, int]:
    counters: dict[str, int] = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, value = line.split()
            counters[key] = int(value)
    try:
        counters["reported_kib"] = int(_REPORTED.read_text())
    except (OSError, ValueError):
        pass
    return counters


class GCClock:
    """Seconds Python's cyclic garbage collector ran, and its passes, while installed."""

    def __init__(self) -> None:
        self.seconds, self.passes, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.passes += 1


def timed(op: str, variant: str, rep: int, size: int, run: Callable[[], None]) -> Record:
    """One operation, timed; the cyclic garbage of the ones before is collected first
    (untimed), so a full collection that another side's garbage brings on is not charged to
    this one: FileSystemWriter leaves about 5,800 objects in reference cycles per save (torch.save
    makes a class per tensor), TieredWriter about 100."""
    gc.collect()
    clock = GCClock()
    gc.callbacks.append(clock)
    before, usage, start = vmstat(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        run()
    finally:
        gc.callbacks.remove(clock)
    seconds = time.perf_counter() - start
    after, done = vmstat(), resource.getrusage(resource.RUSAGE_SELF)
    record: Record = {
        "op": op,
        "variant": variant,
        "rep": rep,
        "bytes": size,
        "seconds": seconds,
        "user": done.ru_utime - usage.ru_utime,
        "sys": done.ru_stime - usage.ru_stime,
        "pgalloc": after.get("pgalloc_normal", 0) - before.get("pgalloc_normal", 0),
        "gc": clock.seconds,
        "gc_passes": clock.passes,
    }
    record["cpu"] = record["user"] + record["sys"]
    if "reported_kib" in after:
        record["reported_mib"] = (after["reported_kib"] - before["reported_kib"]) / 1024
    return record


def page_phase(state: dict[str, Any], root: Path, size: int, reps: int) -> list[Record]:
    """The same bytes written over a file's pages (overwritten in place), then into new
    pages (a new file kept per write)."""
    records: list[Record] = []
    for rep in range(reps):
        records.append(timed("pages", "reused", rep, size, lambda: floor_save(state, root / "reused.bin")))
    for rep in range(reps):
        records.append(
            timed(
                "pages",
                "new",
                rep,
                size,
                lambda rep=rep: floor_save(state, root / f"new{rep}.bin", truncate=True),
            )
        )
    return records


def run(spec: dict[str, Any]) -> list[Record]:
    size, reps = int(spec["bytes"]), int(spec["reps"])
    root = Path(spec.get("root") or TMPFS / f"tierstore-perf-loop-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    (root / "fsw").mkdir(parents=True)
    (root / "floor").mkdir()
    hot = root / "tiered"
    state = make_state(size)
    size = nbytes(state)
    into = blank_like(state)
    saves: dict[str, Callable[[int], None]] = {
        "fsw": lambda k: dcp.save(
            state, storage_writer=FileSystemWriter(root / "fsw" / str(k)), no_dist=True
        ),
        "tiered": lambda k: dcp.save(state, storage_writer=TieredWriter(hot=str(hot), step=k), no_dist=True),
        "floor": lambda k: floor_save(state, root / "floor" / str(k % (KEEP + 1))),
    }
    loads: dict[str, Callable[[int], None]] = {
        "fsr": lambda k: dcp.load(into, storage_reader=FileSystemReader(root / "fsw" / str(k)), no_dist=True),
        "tiered": lambda k: dcp.load(into, storage_reader=TieredReader(hot=str(hot), step=k), no_dist=True),
        "floor": lambda k: floor_load(into, root / "floor" / str(k % (KEEP + 1))),
        "dcp_null": lambda k: dcp.load(into, storage_reader=NullReader(root / "fsw" / str(k)), no_dist=True),
    }
    records: list[Record] = []
    try:
        warm = KEEP + 1
        for k in range(warm + reps):  # step k is rep k - warm: the run's start is warm-up
            step(state)
            shift = k % len(SAVES)
            for name in SAVES[shift:] + SAVES[:shift]:
                records.append(timed("save", name, k - warm, size, lambda name=name, k=k: saves[name](k)))
            for name in LOADS[shift:] + LOADS[:shift]:
                records.append(timed("load", name, k - warm, size, lambda name=name, k=k: loads[name](k)))
            shutil.rmtree(root / "fsw" / str(k - KEEP), ignore_errors=True)
            prune(str(hot), hot_policy=keep_last(KEEP))
            line = "  ".join(
                f"{r['op']} {r['variant']} {r['seconds']:.3f}/{r['cpu']:.3f}"
                for r in records
                if r["rep"] == k - warm
            )
            print(f"    loop rep {k - warm}: {line}", flush=True)
        shutil.rmtree(root / "fsw")
        shutil.rmtree(hot)
        records.extend(page_phase(state, root / "floor", size, max(3, reps // 3)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return records


if __name__ == "__main__":
    module_main(run)
