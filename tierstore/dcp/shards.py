"""The shard files of one save attempt: how a rank's items are spread over files, and how one
file is written, checksummed and made durable (:class:`~tierstore.dcp.writer.TieredWriter`'s
``write_data``), and what travels between the ranks and the coordinator about them.

Data files are raw-encoded by default (:mod:`tierstore.format.encoding`); ``encoding="dcp"``
writes what ``FileSystemWriter`` writes (:mod:`tierstore.dcp.dcp_files`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from tierstore.dcp import dcp_files
from tierstore.format import encoding as raw
from tierstore.format.manifest import FileEntry
from tierstore.storage import faults
from tierstore.tiers.tier import Tier

__all__ = ["AttemptPlan", "ItemResult", "write_file", "plan_bytes", "split_by_size"]


@dataclass(frozen=True)
class AttemptPlan:
    """Coordinator -> each rank, in ``SavePlan.storage_data``."""

    name: str
    step: int | None
    attempt: str
    rank: int
    ranks_per_dir: int = 0  # shards under r<k>/ (layout.data_file_name); 0: all in one directory


@dataclass(frozen=True)
class ItemResult:
    """Each rank -> coordinator, in ``WriteResult.storage_data``; unwrapped in ``finish``."""

    info: _StorageInfo | raw.RawItem
    file: FileEntry | None  # set on the first item of each file


def write_file(
    tier: Tier,
    attempt: AttemptPlan,
    relpath: str,
    items: Sequence[WriteItem],
    resolve: Callable[[WriteItem], Any],
    encoding: str,
    extensions: Sequence[StreamTransformExtension] = (),
) -> list[WriteResult]:
    """Write one shard file in ``encoding``; return its results."""
    key = tier.file_key(attempt.name, attempt.attempt, relpath)
    # Byte items first, then tensors, as DCP's own writer does.
    ordered = sorted(items, key=lambda it: it.type != WriteItemType.BYTE_IO)
    placed: list[tuple[WriteItem, _StorageInfo | raw.RawItem]]
    with tier.backend.open_write(key, defer_dir_sync=True) as out:
        if encoding == "raw":
            # The caller waits for a save on the main thread: the checksums run ahead on a
            # second one there. Anywhere else (dcp.async_save's thread, one of several files'
            # writers) the save is off training's path already, and one thread costs less CPU.
            infos = raw.write_items(
                out,
                ordered,
                resolve,
                relpath,
                names=[item.index.fqn for item in ordered],
                ahead=threading.current_thread() is threading.main_thread(),
            )
            placed = list(zip(ordered, infos))
        else:
            placed = dcp_files.write_items(out, ordered, resolve, relpath, extensions)
    entry = FileEntry(relpath, out.size, out.crc32c, attempt.rank)
    faults.point("writer.after_file_write")
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=info.length,
            storage_data=ItemResult(info, entry if i == 0 else None),
        )
        for i, (item, info) in enumerate(placed)
    ]


def _item_size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def plan_bytes(plan: SavePlan) -> int:
    # Up to ALIGN bytes of padding before each item of a raw file.
    return sum((0 if i.type == WriteItemType.BYTE_IO else _item_size(i)) + raw.ALIGN for i in plan.items)


def split_by_size(bins: int, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
    """Spread items over ``bins`` files by size, as ``FileSystemWriter`` does."""
    if bins == 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensor_items = sorted(
        (it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True
    )
    for i, item in enumerate(byte_items):
        buckets[i % bins].append(item)
    for item in tensor_items:
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_size(item)
    return buckets
