"""The ``load`` operation of a rank (see rank_job.py): one checkpoint per writer, then
``dcp.load`` timed per reader, with the page cache dropped or warm."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor, Shard

from benchmarks.infra.measure import Record, cpu_seconds, now
from benchmarks.jobs import writers
from benchmarks.jobs.rank_context import Context, local_bytes, make_state, where
from benchmarks.jobs.saves import rotated, save_once


@contextmanager
def unverified_reads(enabled: bool) -> Iterator[None]:
    """TieredReader without CRC32C (size checks kept): only to price the verification."""
    from tierstore.dcp import reader as reader_mod
    from tierstore.format.verified import VerifiedStream

    class Unchecked(VerifiedStream):
        def read(self, n: int) -> bytes:
            data: bytes = self._raw.read(n)
            self.pos += len(data)
            return data

        def readinto(self, buffer: memoryview) -> int:
            chunk = self.read(len(buffer))
            buffer[: len(chunk)] = chunk
            return len(chunk)

        def finish(self) -> None:
            self._drain()
            if self.pos != self.entry.size:
                raise self.size_mismatch()

    original = reader_mod.open_verified

    @contextmanager
    def open_unchecked(*args: Any, **kwargs: Any) -> Iterator[VerifiedStream]:
        with original(*args, **kwargs) as stream:
            stream.__class__ = Unchecked  # the same stream, its CRC32C left out
            yield stream

    if not enabled:
        yield
        return
    reader_mod.open_verified = open_unchecked
    try:
        yield
    finally:
        reader_mod.open_verified = original


def drop_caches(ctx: Context) -> None:
    """Evict the page cache (root only) so every load reads the device, not RAM."""
    dist.barrier()
    if ctx.rank == 0 and ctx.spec.get("drop_caches"):
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
        except OSError:
            ctx.spec["drop_caches"] = False
    dist.barrier()


def write_sources(ctx: Context, state: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """One checkpoint per writer the load cases need; returns their local / S3 places."""
    local: dict[str, str] = {}
    s3: dict[str, str] = {}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    needed = {case.split("_")[0] for case in ctx.spec["cases"]}
    plan = [
        ("fsw", "fsw_sync"),
        ("tiered", "tiered_async"),
        ("fsspec", "fsspec_sync"),
        ("s3torch", "s3torch_sync"),
    ]
    for name, variant in plan:
        if name not in needed and not (name == "fsw" and "fsr" in needed):
            continue
        place = where(ctx, f"source-{name}", "direct")
        dist.barrier()
        save_once(ctx, variant, state, place, stager)
        local[name] = place.local
        if place.s3 is not None:
            s3[name] = place.s3
    stager.close()
    return local, s3


def load_once(
    ctx: Context, variant: str, target_state: dict[str, Any], local: dict[str, str], s3: dict[str, str]
) -> Record:
    kind = variant.removesuffix("_warm")

    def load() -> Record:
        reader = writers.make_reader(kind, local, s3, ctx.direct)
        dist.barrier()
        cpu = cpu_seconds()
        start = now()
        with unverified_reads("_nocrc" in variant):
            dcp.load(target_state, storage_reader=reader, process_group=ctx.group)
        return {"load": now() - start, "cpu": cpu_seconds() - cpu}

    if kind == variant:
        drop_caches(ctx)
    else:
        load()  # untimed: the files are in the page cache for the timed load
    return load()


def crc_only(ctx: Context, hot: str) -> float:
    """Seconds to CRC32C this rank's files of the tierstore checkpoint, bytes in memory."""
    from tierstore.storage.backend import crc32c_update
    from tierstore.tiers.tier import Tier

    tier = Tier("hot", hot)
    manifest = tier.find_manifest(writers.CKPT)
    assert manifest is not None
    blobs = []
    for entry in manifest.files_of_rank(ctx.rank):
        with tier.backend.open_read(tier.file_key(manifest.name, manifest.attempt, entry.path)) as f:
            blobs.append(f.read())
    start = now()
    for blob in blobs:
        crc32c_update(0, blob)
    return now() - start


def run_loads(ctx: Context) -> list[Record]:
    spec = ctx.spec
    state = make_state(ctx, spec["bytes"])
    local, s3 = write_sources(ctx, state)
    target = {
        k: DTensor.from_local(torch.zeros_like(v.to_local()), ctx.mesh, [Shard(0)], run_check=False)
        for k, v in state.items()
    }
    records: list[Record] = []
    cases = [{"label": c} for c in spec["cases"]]
    for rep in range(spec["reps"]):
        for case in rotated(cases, rep):
            records.append(_measure_load(ctx, case["label"], rep, state, target, local, s3))
        if "tiered" in local:
            records.append(
                {"variant": "crc_only", "rep": rep, "rank": ctx.rank, "load": crc_only(ctx, local["tiered"])}
            )
    return records


def _measure_load(
    ctx: Context,
    variant: str,
    rep: int,
    state: dict[str, Any],
    target: dict[str, Any],
    local: dict[str, str],
    s3: dict[str, str],
) -> Record:
    record: Record = {"variant": variant, "rep": rep, "rank": ctx.rank, "bytes": local_bytes(state)}
    if rep == 0:
        for tensor in target.values():
            tensor.to_local().zero_()
    try:
        record.update(load_once(ctx, variant, target, local, s3))
        if rep == 0 and not all(torch.equal(state[k].to_local(), target[k].to_local()) for k in state):
            record["error"] = "loaded state differs from the saved state"
    except (Exception, CheckpointException) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:2000]
    detail = record.get("error") or f"{record.get('load', 0):6.2f}s"
    ctx.say(f"    rep {rep + 1}/{ctx.spec['reps']} load {variant:<20} {detail}")
    return record
