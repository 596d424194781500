"""What a save costs in CPU alone: ``python -m benchmarks.jobs.cpu_costs SPEC.json OUT.json``.

One process, no disk, timed in CPU seconds of the process (steady where wall time on a
shared VM is not): the pieces of a tensor save priced per GiB (``torch.save`` with and
without its per-record zip CRC32, tierstore's CRC32C), then whole ``dcp.save`` calls into
tmpfs (``/dev/shm``), where the disk costs nothing and only CPU work differs:
FileSystemWriter and TieredWriter (which turns torch.save's zip CRC32 off while it writes,
finding F1 of the report).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import MiB, Record, cpu_seconds, now

warnings.filterwarnings("ignore")
TMPFS = Path("/dev/shm")


class _Sink:
    """A file-like that keeps nothing: torch.save's own cost, no I/O."""

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


@contextmanager
def zip_crc32(enabled: bool) -> Iterator[None]:
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(saved)


def pieces(state: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    from tierstore.storage.backend import crc32c_update

    def save(crc: bool) -> Callable[[], None]:
        def run() -> None:
            with zip_crc32(crc):
                for tensor in state.values():
                    torch.save(tensor, _Sink())

        return run

    def checksum() -> None:
        for tensor in state.values():
            crc32c_update(0, memoryview(tensor.numpy()).cast("B"))

    return {"torch_save": save(True), "torch_save_nozipcrc": save(False), "crc32c": checksum}


def saves(state: dict[str, torch.Tensor], root: Path) -> dict[str, Callable[[], None]]:
    from tierstore import TieredWriter

    def run(name: str) -> Callable[[], None]:
        def save() -> None:
            where = root / name
            if name == "fsw_tmpfs":
                dcp.save(state, storage_writer=FileSystemWriter(str(where)), no_dist=True)
            else:
                dcp.save(state, storage_writer=TieredWriter(str(where), name="ckpt"), no_dist=True)
            shutil.rmtree(where)

        return save

    return {name: run(name) for name in ("fsw_tmpfs", "tiered_tmpfs")}


def measure(cases: dict[str, Callable[[], None]], reps: int, size: int) -> list[Record]:
    names = list(cases)
    records = []
    for name in names:
        cases[name]()  # warm-up
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            cpu, start = cpu_seconds(), now()
            cases[name]()
            records.append(
                {
                    "variant": name,
                    "rep": rep,
                    "seconds": now() - start,
                    "cpu": cpu_seconds() - cpu,
                    "bytes": size,
                }
            )
    return records


def run(spec: dict[str, Any]) -> dict[str, Any]:
    size = spec["bytes"]
    state = {f"w{i}": torch.rand(16 * MiB // 4) for i in range(max(1, size // (16 * MiB)))}
    size = sum(t.numel() * 4 for t in state.values())
    records = measure(pieces(state), spec["reps"], size)
    tmpfs = TMPFS.is_dir() and shutil.disk_usage(TMPFS).free > 3 * size
    if tmpfs:
        root = Path(tempfile.mkdtemp(dir=TMPFS, prefix="tierstore-bench-"))
        try:
            records += measure(saves(state, root), spec["reps"], size)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for r in records:
        if r["rep"] == 0 and r["variant"].endswith("tmpfs"):
            print(f"    {r['variant']:<24} {r['seconds']:.3f}s ({r['cpu']:.3f}s CPU)", flush=True)
    return {"bytes": size, "tmpfs": tmpfs, "records": records}


if __name__ == "__main__":
    module_main(run)
