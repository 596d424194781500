"""Issue 14's save and load costs: ``python -m benchmarks.jobs.perf_io SPEC.json OUT.json``.

One process, no process group, a model + optimizer state of mixed tensor sizes
(``perf_common.make_state``). Each case is timed in wall seconds and in CPU seconds of the
process (every thread); the report compares the best of the reps of each side.

- **Saves** on tmpfs (``/dev/shm``: the disk costs nothing, only CPU work differs) and on
  the disk (the scratch directory): ``TieredWriter`` with the raw and with the dcp
  encoding, DCP's ``FileSystemWriter``, the same bytes written by one ``os.write`` loop
  (fsynced, file and directory), and ``dcp_null``: ``dcp.save`` through a writer that
  resolves every item and writes nothing, which is DCP's own per-save machinery (planning,
  metadata, one ``WriteItem`` per tensor), paid by every DCP ``StorageWriter``.
- **Loads** of the same state into allocated tensors: ``TieredReader`` of a raw checkpoint
  with 1 and 4 threads, of a dcp-encoded one, and ``FileSystemReader`` of
  ``FileSystemWriter``'s. Warm: the files read once, untimed, right before; cold (disk
  only; tmpfs has no device behind its cache): every file fsynced and dropped from the page
  cache (``POSIX_FADV_DONTNEED``) right before.
- **CRC32C share**: the raw load with its block verification, and with
  ``tierstore.format.encoding.verify_blocks`` replaced by a no-op, back to back.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, Metadata, StorageWriter
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import Record
from benchmarks.jobs.perf_common import (
    TMPFS,
    Case,
    best_of,
    blank_like,
    drop_from_cache,
    features,
    fresh_dir,
    make_state,
    nbytes,
    read_through,
    reader_options,
    unavailable,
    writer_encoding,
)
from benchmarks.jobs.writers import write_raw

warnings.filterwarnings("ignore")
SAVES = ("fsw", "tiered_dcp", "tiered_raw", "tiered_raw_direct", "raw_write", "dcp_null")
LOADS = ("fsr", "tiered_dcp", "tiered_raw_t1", "tiered_raw_t4")
LOAD_PLACES = (("tmpfs", "warm"), ("disk", "warm"), ("disk", "cold"))


def writer_args(variant: str, found: dict[str, str | None]) -> dict[str, Any] | str:
    """TieredWriter arguments of a save variant, or why this tree cannot run it."""
    if variant == "tiered_dcp":
        # Before the raw encoding landed, the dcp encoding was the only one (and the default).
        return writer_encoding("dcp") if found["encoding"] is None else {}
    if found["encoding"] is not None:
        return str(found["encoding"])
    if variant == "tiered_raw_direct":
        if found["direct_io"] is not None:
            return str(found["direct_io"])
        return {**writer_encoding("raw"), "hot_options": {"direct_io": True}}
    return writer_encoding("raw")


class NullWriter(StorageWriter):
    """A DCP ``StorageWriter`` that resolves every item (as every writer must) and writes
    nothing: ``dcp.save`` through it costs DCP's own machinery and nothing else."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def validate_checkpoint_id(self, checkpoint_id: Any) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            planner.resolve_data(item)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass


class NullReader(FileSystemReader):
    """A DCP ``StorageReader`` over a ``FileSystemWriter`` checkpoint that reads its metadata
    and no byte of its data: every tensor item is resolved and committed (as every reader
    must) and left as it was. ``dcp.load`` through it costs DCP's own load machinery (planning,
    one ``ReadItem`` per tensor) and nothing else."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            if req.type != LoadItemType.BYTE_IO:
                planner.commit_tensor(req, planner.resolve_tensor(req))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def save_cases(
    state: dict[str, Any], root: Path, place: str, found: dict[str, str | None]
) -> tuple[dict[str, Case], list[Record]]:
    from tierstore import TieredWriter

    cases: dict[str, Case] = {}
    missing: list[Record] = []
    views = [
        memoryview(t.reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]
        for t in state.values()
        if isinstance(t, torch.Tensor)
    ]

    def case(variant: str, save: Callable[[Path], Record | None]) -> Case:
        def empty() -> None:
            fresh_dir(root, variant)

        return (empty, lambda: save(root / variant))

    def fsw(path: Path) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)

    def raw_write(path: Path) -> Record:
        return {"fsync": write_raw(views, str(path / "data"))}

    def null(path: Path) -> None:
        dcp.save(state, storage_writer=NullWriter(), no_dist=True)

    def tiered(args: dict[str, Any]) -> Callable[[Path], None]:
        def save(path: Path) -> None:
            dcp.save(state, storage_writer=TieredWriter(str(path), name="ckpt", **args), no_dist=True)

        return save

    for variant in SAVES:
        if variant == "tiered_raw_direct" and place == "tmpfs":
            continue  # tmpfs refuses O_DIRECT: the same as tiered_raw there
        plain = {"fsw": fsw, "raw_write": raw_write, "dcp_null": null}
        args = {} if variant in plain else writer_args(variant, found)
        if isinstance(args, str):
            missing.append(unavailable(variant, args, op="save", place=place))
        else:
            cases[variant] = case(variant, plain.get(variant) or tiered(args))
    return cases, missing


def write_sources(state: dict[str, Any], root: Path, found: dict[str, str | None]) -> dict[str, Path]:
    """One checkpoint per encoding the loads read (untimed)."""
    from tierstore import TieredWriter

    sources = {"fsw": fresh_dir(root, "src-fsw")}
    dcp.save(state, storage_writer=FileSystemWriter(str(sources["fsw"])), no_dist=True)
    for encoding in ("dcp", "raw"):
        args = writer_args(f"tiered_{encoding}", found)
        if isinstance(args, dict):
            sources[encoding] = fresh_dir(root, f"src-{encoding}")
            dcp.save(
                state, storage_writer=TieredWriter(str(sources[encoding]), name="ckpt", **args), no_dist=True
            )
    return sources


def reader_for(variant: str, sources: dict[str, Path], found: dict[str, str | None]) -> Any:
    """A StorageReader for a load variant, or (a str) why this tree cannot run it."""
    from tierstore import TieredReader

    if variant == "fsr":
        return lambda: FileSystemReader(str(sources["fsw"]))
    if variant == "tiered_dcp":
        return lambda: TieredReader(str(sources["dcp"]), name="ckpt")
    if "raw" not in sources:
        return str(found["encoding"])
    threads = int(variant.rsplit("_t", 1)[1])
    if found["reader_threads"] is not None:
        return (
            str(found["reader_threads"])
            if threads > 1
            else (lambda: TieredReader(str(sources["raw"]), name="ckpt"))
        )
    return lambda: TieredReader(str(sources["raw"]), name="ckpt", **reader_options(thread_count=threads))


def source_of(variant: str, sources: dict[str, Path]) -> Path:
    return sources["fsw" if variant == "fsr" else "dcp" if variant == "tiered_dcp" else "raw"]


def load_cases(
    state: dict[str, Any], sources: dict[str, Path], place: str, cache: str, found: dict[str, str | None]
) -> tuple[dict[str, Case], list[Record]]:
    target = blank_like(state)
    cases: dict[str, Case] = {}
    missing: list[Record] = []
    before = read_through if cache == "warm" else drop_from_cache
    for variant in LOADS:
        make = reader_for(variant, sources, found)
        if isinstance(make, str):
            missing.append(unavailable(variant, make, op="load", place=place, cache=cache))
            continue
        cases[variant] = _load_case(target, make, before, source_of(variant, sources))
    return cases, missing


def _load_case(
    target: dict[str, Any], make: Callable[[], Any], before: Callable[[Path], None], source: Path
) -> Case:
    def prepare() -> None:
        before(source)

    def load() -> None:
        dcp.load(target, storage_reader=make(), no_dist=True)

    return (prepare, load)


def check_loads(
    state: dict[str, Any], sources: dict[str, Path], found: dict[str, str | None]
) -> dict[str, str]:
    """Each reader's load compared with the state saved, once, untimed: a fast reader that
    loads wrong bytes must not pass for a fast one."""
    problems: dict[str, str] = {}
    for variant in LOADS:
        make = reader_for(variant, sources, found)
        if isinstance(make, str):
            continue
        target = blank_like(state)
        try:
            dcp.load(target, storage_reader=make(), no_dist=True)
        except Exception as err:  # reported per case by the timed runs too
            problems[variant] = f"{type(err).__name__}: {err}"[:500]
            continue
        wrong = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not torch.equal(v, target[k])]
        if wrong or target["train.progress"] != state["train.progress"]:
            problems[variant] = f"loaded values differ from the saved ones ({wrong[:3]}...)"
    return problems


@contextmanager
def verification(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, ``verify_blocks`` is a no-op wherever tierstore holds it
    (its module, and any module that imported the name): benchmark only."""
    if enabled:
        yield
        return
    from tierstore.format import encoding

    original = encoding.verify_blocks

    def skip(*args: Any, **kwargs: Any) -> None:
        return None

    holders = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("tierstore") and getattr(m, "verify_blocks", None) is original
    ]
    for module in holders:
        module.verify_blocks = skip  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in holders:
            module.verify_blocks = original


def crc_cases(
    state: dict[str, Any], sources: dict[str, Path], found: dict[str, str | None]
) -> tuple[dict[str, Case], list[Record]]:
    reason = found["encoding"] if "raw" not in sources else found["verify_blocks"]
    if reason is not None:
        return {}, [unavailable(v, reason, op="crc") for v in ("crc_on", "crc_off")]
    target = blank_like(state)
    make = reader_for("tiered_raw_t1", sources, found)

    def load(verify: bool) -> Callable[[], None]:
        def run() -> None:
            with verification(verify):
                dcp.load(target, storage_reader=make(), no_dist=True)

        return run

    return {"crc_on": load(True), "crc_off": load(False)}, []


def run(spec: dict[str, Any]) -> dict[str, Any]:
    reps = spec["reps"]
    state = make_state(spec["bytes"])
    size = nbytes(state)
    found = features()
    load = os.getloadavg()[0]
    roots = {"disk": Path(spec["scratch"]) / "perf-io"}
    if TMPFS.is_dir() and shutil.disk_usage(TMPFS).free > 6 * size:
        roots["tmpfs"] = Path(tempfile.mkdtemp(dir=TMPFS, prefix="tierstore-perf-"))
    records: list[Record] = []
    checks: dict[str, dict[str, str]] = {}
    try:
        for place, root in sorted(roots.items(), reverse=True):  # tmpfs first
            print(f"  perf: saves on {place}, {size / 2**20:.0f} MiB", flush=True)
            cases, missing = save_cases(state, root, place, found)
            records += missing + best_of(cases, size, reps, op="save", place=place)
            for variant in SAVES:
                shutil.rmtree(root / variant, ignore_errors=True)
            sources = write_sources(state, root, found)
            checks[place] = check_loads(state, sources, found)
            for load_place, cache in LOAD_PLACES:
                if load_place == place:
                    print(f"  perf: loads from {place}, {cache} page cache", flush=True)
                    cases, missing = load_cases(state, sources, place, cache, found)
                    records += missing + best_of(cases, size, reps, op="load", place=place, cache=cache)
            if place == ("tmpfs" if "tmpfs" in roots else "disk"):
                print(f"  perf: CRC32C A/B, raw load from {place}", flush=True)
                cases, missing = crc_cases(state, sources, found)
                records += missing + best_of(cases, size, reps, op="crc", place=place)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    tensors = [t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)]
    import crc32c

    return {
        "bytes": size,
        "reps": reps,
        "features": found,
        "places": sorted(roots),
        "crc_hardware": bool(getattr(crc32c, "hardware_based", False)),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg": [load, os.getloadavg()[0]],
        "load_checks": checks,
        "tensors": len(tensors),
        "largest": max(tensors),
        "smallest": min(tensors),
        "records": records,
    }


if __name__ == "__main__":
    module_main(run)
