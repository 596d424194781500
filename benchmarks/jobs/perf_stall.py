"""Issue 14's stall: ``python -m benchmarks.jobs.perf_stall SPEC.json OUT.json``.

No process group, the state of ``perf_common.make_state`` saved ``saves`` times by each
system, each save waited for until durable before the next, with a short untimed pause
between saves (in training they are minutes apart). ``spec["only"]`` picks the systems this
process runs; the perf suite runs each in a process of its own, so no system's background
threads or helper processes count in another's CPU (several in one process are interleaved:
save *i* of each, in an order rotated with *i*):

- ``CheckpointManager`` with ``StagingOptions(buffers="reuse")`` (its default: ``save()``
  returns once the state is copied into buffers kept from save to save), the same with
  ``overlap=True`` (``save()`` returns as the copy starts), and with ``buffers="fresh"``
  (new buffers on every save, DCP's default); trees before ``StagingOptions`` take
  ``staging="reuse"``, ``overlap_staging=True``, ``staging="fresh"``;
- a synchronous ``dcp.save`` through ``TieredWriter`` (the baseline of the stall target);
- DCP's own ``async_save`` + ``FileSystemWriter`` with its best staging on a CPU-only
  machine (``DefaultStager`` with asynchronous staging, no pinned or shared memory), and
  with ``FileSystemWriter(cache_staged_state_dict=True)``;
- Meta's ``torch_checkpointing`` ``CheckpointManager``, async, configured for CPU as its
  troubleshooting guide says (no pinned memory, no non-blocking copies); it writes from a
  process of its own and never fsyncs, so its time to durable adds an fsync of its files.

Per save: ``stall`` (the save call), ``staged`` (until the state may change again),
``durable`` (until the checkpoint is on disk, fsynced), ``cpu`` (this process and its
children, from the call to durable). The first save of each (allocations, imports, the
peers' helper processes) is kept apart from the steady state (saves 2..N).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import Record, await_async_save, now
from benchmarks.jobs.perf_common import (
    TMPFS,
    accepts,
    features,
    fsync_tree,
    make_state,
    measure,
    nbytes,
    options_module,
)

warnings.filterwarnings("ignore")
SETTLE = 0.2  # seconds between saves (untimed)
Save = Callable[[int], Record | None]  # save number i; returns stall/staged/durable fields


class System:
    """One way of checkpointing: ``save(i)`` blocks until save ``i`` is durable."""

    def __init__(self, root: Path, state: dict[str, Any]) -> None:
        self.root, self.state = root, state
        root.mkdir(parents=True, exist_ok=True)

    def save(self, i: int) -> Record | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def staging(buffers: str | None = None, overlap: bool = False) -> dict[str, Any]:
    """The ``CheckpointManager`` keywords for this staging, in this tree's form: its
    ``StagingOptions``, or the keywords older trees took (``staging="reuse"``, ...)."""
    options = options_module()
    if options is not None:
        return {"staging": options.StagingOptions(buffers=buffers or "reuse", overlap=overlap)}
    return {**({"staging": buffers} if buffers else {}), **({"overlap_staging": True} if overlap else {})}


class Ours(System):
    def __init__(self, root: Path, state: dict[str, Any], **options: Any) -> None:
        from tierstore import CheckpointManager

        super().__init__(root, state)
        given = options.get("staging")
        self.overlap = bool(options.get("overlap_staging") or getattr(given, "overlap", False))
        self.manager = CheckpointManager(str(root), save_every=None, **options)

    def save(self, i: int) -> Record:
        start = now()
        self.manager.save(i + 1, self.state)
        stall = now() - start
        if self.overlap:
            self.manager.wait_staged()
        staged = now() - start
        self.manager.wait(migrations=False)
        allocated = getattr(self.manager, "staging_allocated", {}).get(i + 1)
        return {
            "stall": stall,
            "staged": staged,
            "durable": now() - start,
            **({"allocated": allocated} if allocated is not None else {}),
        }

    def close(self) -> None:
        self.manager.close()


class SyncTiered(System):
    def save(self, i: int) -> Record:
        from tierstore import TieredWriter

        start = now()
        dcp.save(self.state, storage_writer=TieredWriter(str(self.root), step=i + 1), no_dist=True)
        took = now() - start
        shutil.rmtree(self.root / f"step-{i - 1}", ignore_errors=True)  # keep two, untimed
        return {"stall": took, "staged": took, "durable": took}


class DcpAsync(System):
    def __init__(self, root: Path, state: dict[str, Any], *, cached: bool = False) -> None:
        super().__init__(root, state)
        self.cached = cached
        # The best staging DCP offers without an accelerator (see /work/shared/STACK.md):
        # pinned and shared memory need one; asynchronous staging does not.
        self.stager = None if cached else DefaultStager(StagingOptions(False, False, True, False))

    def save(self, i: int) -> Record:
        path = self.root / f"step-{i}"
        writer = FileSystemWriter(str(path), cache_staged_state_dict=self.cached)
        start = now()
        response = dcp.async_save(self.state, storage_writer=writer, async_stager=self.stager, no_dist=True)
        stall, staged, durable = await_async_save(response, start)
        shutil.rmtree(self.root / f"step-{i - 2}", ignore_errors=True)
        return {"stall": stall, "staged": staged, "durable": durable}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TorchCheckpointing(System):
    """torch_checkpointing's async CheckpointManager, CPU-only configuration."""

    def __init__(self, root: Path, state: dict[str, Any]) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig

        super().__init__(root, state)
        # Its troubleshooting guide: pinned memory and non-blocking copies need an
        # accelerator; everything else (shared memory, async staging, O_DIRECT with its own
        # fallback) stays at its defaults.
        staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
        self.manager = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(staging_config=staging)
        ).build()
        self.payload = {
            "model": {k: v for k, v in state.items() if k.startswith("model.")},
            "optim": {k: v for k, v in state.items() if k.startswith("optim.")},
            "train": state["train.progress"],
        }

    def save(self, i: int) -> Record:
        path = self.root / f"step-{i}"
        start = now()
        future = self.manager.save(str(path), self.payload)
        stall = now() - start
        with self.manager.lock():  # returns once the state is captured
            staged = now() - start
        if future is not None:
            future.result()
        written = now() - start
        fsync_tree(path)  # it never fsyncs: what durable costs is added here
        durable = now() - start
        shutil.rmtree(self.root / f"step-{i - 2}", ignore_errors=True)
        return {"stall": stall, "staged": staged, "written": written, "durable": durable}

    def close(self) -> None:
        self.manager.close()


def systems(found: dict[str, str | None]) -> dict[str, Callable[[Path, dict[str, Any]], System] | str]:
    """Each system by name, or why it cannot run here."""
    from tierstore import CheckpointManager

    out: dict[str, Callable[[Path, dict[str, Any]], System] | str] = {
        "ours_reuse": lambda r, s: Ours(r, s, **staging("reuse")),
        "ours_overlap": lambda r, s: Ours(r, s, **staging("reuse", overlap=True)),
        "ours_fresh": lambda r, s: Ours(r, s, **staging("fresh")),
        "sync_tiered": SyncTiered,
        "dcp_async": DcpAsync,
        "dcp_async_cached": lambda r, s: DcpAsync(r, s, cached=True),
        "torch_checkpointing": TorchCheckpointing,
    }
    if found["staging"] is not None:
        out["ours_reuse"] = out["ours_overlap"] = str(found["staging"])
        out["ours_fresh"] = lambda r, s: Ours(r, s)  # before issue 14: fresh buffers every save
    elif options_module() is None and not accepts(CheckpointManager, "overlap_staging"):
        out["ours_overlap"] = "CheckpointManager takes no overlap_staging="
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as err:
        out["torch_checkpointing"] = f"not installed ({err}): make bench installs it"
    return out


def copy_floor(state: dict[str, Any], reps: int = 5) -> float:
    """The best time to copy the state into buffers allocated beforehand: the least a save
    that returns once its copy is taken can stall."""
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    buffers = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(reps):
        start = now()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)
        times.append(now() - start)
    return min(times)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    state = make_state(spec["bytes"])
    size = nbytes(state)
    found = features()
    copy = copy_floor(state)
    load = os.getloadavg()[0]
    tmpfs = TMPFS.is_dir() and shutil.disk_usage(TMPFS).free > 12 * size
    root = Path(tempfile.mkdtemp(dir=TMPFS if tmpfs else spec["scratch"], prefix="tierstore-stall-"))
    records: list[Record] = []
    running: dict[str, System] = {}
    try:
        for name, make in systems(found).items():
            if spec.get("only") and name not in spec["only"]:
                continue
            if isinstance(make, str):
                records.append({"variant": name, "rep": 0, "unavailable": make})
                continue
            try:
                running[name] = make(root / name, state)
            except Exception as err:
                records.append({"variant": name, "rep": 0, "error": f"{type(err).__name__}: {err}"[:2000]})
        broken: set[str] = set()
        for i in range(spec["saves"]):
            names = [n for n in running if n not in broken]
            shift = i % max(1, len(names))
            for name in names[shift:] + names[:shift]:
                time.sleep(SETTLE)
                record = measure(name, partial(running[name].save, i), size, i, first=i == 0)
                records.append(record)
                if record.get("error"):
                    broken.add(name)
                _say(record)
    finally:
        for system in running.values():
            try:
                system.close()
            except Exception as err:
                print(f"    closing failed: {type(err).__name__}: {err}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "bytes": size,
        "saves": spec["saves"],
        "hot": "tmpfs" if tmpfs else "disk",
        "features": found,
        "copy": copy,
        "loadavg": [load, os.getloadavg()[0]],
        "records": records,
    }


def _say(record: Record) -> None:
    head = f"    save {record['rep'] + 1} {record['variant']:<20}"
    if record.get("error"):
        print(f"{head} ERROR {record['error'][:200]}", flush=True)
    else:
        print(
            f"{head} stall {record['stall']:6.3f}s  staged {record['staged']:6.3f}s  "
            f"durable {record['durable']:6.3f}s  cpu {record['cpu']:6.3f}s",
            flush=True,
        )


if __name__ == "__main__":
    module_main(run)
