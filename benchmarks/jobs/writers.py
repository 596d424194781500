"""The storage writers and readers compared, built by name (one name, one variant).

Writers: ``disk`` (raw bytes, write + fsync: the hardware baseline, no writer at all),
``fsw`` (DCP ``FileSystemWriter``), ``tiered`` (``TieredWriter``, with a cold tier when the
job has S3), ``fsspec`` (DCP ``FsspecWriter`` straight to S3), ``s3torch``
(s3torchconnector's DCP ``S3StorageWriter``). A ``_sync`` suffix saves with ``dcp.save``,
``_async`` with ``dcp.async_save``. Readers are named ``<reader>_<tier>``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from benchmarks.infra.servers import REGION, S3Target

CKPT = "ckpt"  # the checkpoint name inside each tierstore store
SAVERS = ("disk", "fsw", "tiered", "fsspec", "s3torch")
S3_WRITERS = ("fsspec", "s3torch")


@dataclass(frozen=True)
class Where:
    """Fresh places for one measurement: a local directory and an S3 prefix (if any)."""

    local: str
    s3: str | None
    target: S3Target | None


def writer_kind(variant: str) -> str:
    return variant.rsplit("_", 1)[0]


def is_async(variant: str) -> bool:
    return variant.endswith("_async")


def uses_s3(variant: str, has_s3: bool) -> bool:
    kind = writer_kind(variant)
    return kind in S3_WRITERS or (kind == "tiered" and is_async(variant) and has_s3)


def make_writer(variant: str, where: Where) -> StorageWriter:
    kind = writer_kind(variant)
    if kind == "fsw":
        return FileSystemWriter(where.local)
    if kind == "tiered":
        return _tiered_writer(variant, where)
    assert where.s3 is not None and where.target is not None, f"{variant} needs S3"
    if kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files=False: with True it calls os.sync() per shard, which means nothing
        # for S3 and would charge the local disk's dirty pages to the S3 writer.
        return FsspecWriter(where.s3, sync_files=False, **where.target.fsspec_options())
    if kind == "s3torch":
        return s3torch_writer(where.s3, where.target)
    raise ValueError(f"unknown writer {variant!r}")


def _tiered_writer(variant: str, where: Where) -> StorageWriter:
    from tierstore import Store, TieredWriter

    # The cold tier only under async_save: the sync variant measures the hot write alone.
    if is_async(variant) and where.s3 is not None and where.target is not None:
        return TieredWriter(
            Store.of(where.local, where.s3, cold_options=where.target.tier_options()), name=CKPT
        )
    return TieredWriter(where.local, name=CKPT)


def s3torch_client(target: S3Target) -> Any:
    """An s3torchconnector client pointed at ``target`` (its DCP classes take no endpoint)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    config = S3ClientConfig(force_path_style=True)
    client = S3Client(REGION, endpoint=target.endpoint, s3client_config=config)
    return S3FileSystem(REGION, s3_client=client), config


def s3torch_writer(url: str, target: S3Target) -> StorageWriter:
    from s3torchconnector.dcp import S3StorageWriter

    fs, config = s3torch_client(target)
    writer = S3StorageWriter(REGION, url, s3client_config=config)
    writer.fs = fs  # the endpoint override: S3StorageWriter builds a client for AWS
    return writer


def s3torch_reader(url: str, target: S3Target) -> StorageReader:
    from s3torchconnector.dcp import S3StorageReader

    fs, config = s3torch_client(target)
    reader = S3StorageReader(REGION, url, s3client_config=config)
    reader.fs = fs
    return reader


def make_reader(
    variant: str, local: dict[str, str], s3: dict[str, str], target: S3Target | None
) -> StorageReader:
    """``local``/``s3``: where each writer's checkpoint for the load benchmark lies."""
    from tierstore import Store, TieredReader

    kind = variant.removesuffix("_nocrc")
    if kind == "fsr_hot":
        return FileSystemReader(local["fsw"])
    if kind == "tiered_hot":
        return TieredReader(local["tiered"], None, name=CKPT)
    assert target is not None, f"{variant} needs S3"
    if kind == "tiered_cold":
        return TieredReader(Store.of(None, s3["tiered"], cold_options=target.tier_options()), name=CKPT)
    if kind == "fsspec_cold":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(s3["fsspec"], **target.fsspec_options())
    if kind == "s3torch_cold":
        return s3torch_reader(s3["s3torch"], target)
    raise ValueError(f"unknown reader {variant!r}")


def write_raw(views: list[memoryview], path: str) -> float:
    """The disk baseline: the same bytes, written sequentially, file and directory fsynced.

    Returns the seconds spent in the fsyncs (how much the device, not the page cache, cost).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in views:
            while view:
                view = view[os.write(fd, view[: 1 << 30]) :]
        start = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return time.perf_counter() - start
