"""This process's place in a ``torch.distributed`` job: the one rank/world helper.

Without an initialized default process group a process is rank 0 of a world of 1. Nothing
here imports ``torch.distributed``: a process group can only exist if something imported it
already, so modules usable without it (``resume.data``, ``resume.cadence``) stay light.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["initialized", "rank_world", "broadcast", "all_gather"]


def _dist() -> Any:
    """``torch.distributed`` if imported and initialized, else ``None``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def initialized() -> bool:
    """Whether a default process group is up."""
    return _dist() is not None


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` in the default group; ``(0, 1)`` outside a distributed job."""
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def broadcast(value: Any, group: Any) -> Any:
    """The value of ``group``'s first rank, on every rank of it (``value`` when not distributed)."""
    dist = _dist()
    if dist is None:
        return value
    box = [value]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (``[value]`` when not distributed)."""
    dist = _dist()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
