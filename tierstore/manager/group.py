"""The process group of a manager's collectives, which its parts share."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tierstore import _dist

__all__ = ["Group"]


class Group:
    """The group every part of a manager runs its collectives on: a gloo group of the manager's
    own unless one was given (DCP's async saves run collectives from a background thread, which
    must never interleave with training's); ``None`` outside ``torch.distributed``, and once
    :meth:`release` destroyed the manager's own."""

    def __init__(self, given: Any = None) -> None:
        self.distributed = _dist.initialized()
        self.rank = _dist.rank_world()[0]  # in the default group
        self.owned = given is None and self.distributed
        self.group: Any = dist.new_group(backend="gloo") if self.owned else given

    def release(self) -> None:
        """Destroy the group if the manager made it (a given one stays the caller's)."""
        if self.owned and self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
