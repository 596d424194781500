"""What the performance jobs (``perf_io``, ``perf_stall``) share: the state they save, which
of issue 14's features this tree has, the page-cache controls and the best-of loop.

A feature not in the tree yet (an argument a constructor does not take, a function not
there) makes its cases report ``unavailable`` with the reason, never crash the run: the
suite runs against whatever has landed.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from benchmarks.infra.measure import MiB, Record, now, tree_cpu_seconds

TMPFS = Path("/dev/shm")
LAYERS = 8
Run = Callable[[], Record | None]  # one measurement; returns extra fields, if any
# A case: what is timed, or (untimed preparation, what is timed)
Case = Run | tuple[Callable[[], None], Run]


def make_state(size: int, seed: int = 14) -> dict[str, Any]:
    """A model + Adam-like optimizer state of about ``size`` bytes, in tensors of mixed sizes.

    A third is the model (an embedding, per layer attention and MLP matrices, norms and
    biases of a few KiB), two thirds its optimizer (``exp_avg``, ``exp_avg_sq`` and a 0-dim
    ``step`` per parameter), and a few plain values (DCP ``BYTE_IO`` items).
    """
    floats = size // 3 // 4
    width = max(64, int(math.sqrt(floats / (12 * LAYERS + 8))) // 64 * 64)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8 * width, width)}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        shapes |= {
            p + "attn.qkv.weight": (3 * width, width),
            p + "attn.qkv.bias": (3 * width,),
            p + "attn.out.weight": (width, width),
            p + "mlp.up.weight": (4 * width, width),
            p + "mlp.up.bias": (4 * width,),
            p + "mlp.down.weight": (width, 4 * width),
            p + "norm1.weight": (width,),
            p + "norm2.weight": (width,),
        }
    used = sum(math.prod(shape) for shape in shapes.values())
    if floats - used >= width:  # the rest, in one more matrix (an output head)
        shapes["head.weight"] = ((floats - used) // width, width)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, shape in shapes.items():
        state[f"model.{name}"] = torch.rand(shape, generator=gen)
        state[f"optim.{name}.exp_avg"] = torch.rand(shape, generator=gen)
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=gen)
        state[f"optim.{name}.step"] = torch.tensor(1000.0)
    state["train.progress"] = {"step": 1000, "epoch": 3, "lr": 3e-4}
    return state


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target: the same structure, tensors allocated (not filled), plain values reset."""
    return {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v, -1)
        for k, v in state.items()
    }


def accepts(func: Any, name: str) -> bool:
    return name in inspect.signature(func).parameters


def options_module() -> Any | None:
    """``tierstore.options`` (``WriterOptions``, ``StagingOptions``) in a tree that has it, else
    ``None``: older trees take the same settings as keywords of the constructors."""
    try:
        return importlib.import_module("tierstore.options")
    except ImportError:
        return None


def writer_encoding(encoding: str) -> dict[str, Any]:
    """The ``TieredWriter`` keywords that choose ``encoding``, in this tree's form."""
    options = options_module()
    if options is None:
        return {"encoding": encoding}
    return {"options": options.WriterOptions(encoding=encoding)}


def reader_options(**options: Any) -> dict[str, Any]:
    """The ``TieredReader`` keywords for ``options`` (``thread_count``, ``lease``), in this
    tree's form: its ``ReaderOptions``, or the keywords older trees took."""
    module = options_module()
    if module is None or not hasattr(module, "ReaderOptions"):
        return options
    return {"options": module.ReaderOptions(**options)}


def features() -> dict[str, str | None]:
    """Issue 14's features by name: ``None`` if this tree has it, else why not."""
    probes: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
        "encoding": (
            "tierstore.dcp.writer",
            "TieredWriter",
            lambda c: accepts(c, "encoding") or options_module() is not None,  # WriterOptions'
        ),
        "reader_threads": (
            "tierstore.dcp.reader",
            "TieredReader",
            lambda c: accepts(c, "thread_count") or hasattr(options_module(), "ReaderOptions"),
        ),
        "staging": ("tierstore.manager", "CheckpointManager", lambda c: accepts(c, "staging")),
        # LocalBackend takes **options: its source names the option once it is there.
        "direct_io": (
            "tierstore.storage.local",
            "LocalBackend",
            lambda c: "direct_io" in inspect.getsource(c),
        ),
        "verify_blocks": ("tierstore.format.encoding", "verify_blocks", callable),
    }
    found: dict[str, str | None] = {}
    for feature, (module, name, has) in probes.items():
        try:
            value = getattr(importlib.import_module(module), name, None)
        except Exception as err:
            found[feature] = f"{module} does not import ({type(err).__name__}: {err})"[:300]
            continue
        found[feature] = (
            None if value is not None and has(value) else f"{module}.{name} lacks it (not landed)"
        )
    return found


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (for a peer that never fsyncs what it writes)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_from_cache(root: Path) -> None:
    """Evict ``root``'s files from the page cache, file by file (no root needed): fsync,
    then ``POSIX_FADV_DONTNEED`` (the kernel drops only clean pages)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(root: Path) -> None:
    """Read ``root``'s files once (untimed), so the next load finds them in the page cache."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 * MiB):
                pass


def fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def measure(variant: str, case: Case, size: int, rep: int, **fields: Any) -> Record:
    """One timed run of ``case``: wall and CPU seconds (this process and its children)."""
    record: Record = {"variant": variant, "rep": rep, "bytes": size, **fields}
    try:
        if isinstance(case, tuple):
            case[0]()
            case = case[1]
        cpu, start = tree_cpu_seconds(), now()
        extra = case()
    except (Exception, CheckpointException) as err:  # a BaseException, in DCP
        record["error"] = f"{type(err).__name__}: {err}"[:2000]
        return record
    record.update(seconds=now() - start, cpu=tree_cpu_seconds() - cpu, **(extra or {}))
    return record


def best_of(
    cases: dict[str, Case], size: int, reps: int, *, rotate: bool = True, say: str = "", **fields: Any
) -> list[Record]:
    """Each case once untimed, then ``reps`` timed runs each, back to back, in an order
    rotated every rep; a case that fails is not run again."""
    names = list(cases)
    failed: dict[str, Record] = {}
    for name in names:
        warm = measure(name, cases[name], size, -1, **fields)
        if warm.get("error"):
            failed[name] = {**warm, "rep": 0}
    records = list(failed.values())
    for rep in range(reps):
        shift = rep % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            if name not in failed:
                records.append(measure(name, cases[name], size, rep, **fields))
    for name in names:
        runs = [r for r in records if r["variant"] == name and "seconds" in r]
        if runs:
            best = min(runs, key=lambda r: r["seconds"])
            print(
                f"    {say}{name:<24} best {best['seconds']:.3f}s  cpu {min(r['cpu'] for r in runs):.3f}s",
                flush=True,
            )
        elif name in failed:
            print(f"    {say}{name:<24} ERROR {failed[name]['error'][:160]}", flush=True)
    return records


def unavailable(variant: str, reason: str, **fields: Any) -> Record:
    return {"variant": variant, "rep": 0, "unavailable": reason, **fields}
