"""A local hot tier that cannot be written fails when the manager is built, not at the first save.

Before, a hot directory on a read-only mount or owned by another user was found only by the
first save, ``save_every`` steps into the run, and on a small read-only mount reported as
``NoSpaceLeft`` (issue 38). The manager now publishes one small object under the tier's root
and deletes it, through the tier's backend (the calls a save makes: make the directories,
create exclusively, fsync, link, fsync the directory, unlink), and a refusal by the file
system (``EROFS``, ``EACCES``, ``EPERM``) raises :class:`~tierstore.errors.StorageError`
naming the tier, its path and what to do. A full tier is no refusal: retention may free space
before a save (``Retention(hot_min_free=...)``), so it is only logged.

Who probes: the group's first rank for a hot tier all ranks share (one publish for the whole
job), every rank for node-local ones (each node's own disk). Only local tiers are probed: an
object store as the hot tier would pay requests for what its first save says as clearly.
Every rank learns the first refusal (one tiny all-reduce, then a broadcast only on failure)
and raises it, so none is left waiting in a collective for a rank that gave up.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from typing import Any

import torch

from tierstore import _dist
from tierstore.errors import NoSpaceLeft, StorageError
from tierstore.format import layout
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Tier

__all__ = ["check_writable"]

log = logging.getLogger(__name__)

_REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM}


def check_writable(hot: Tier, group: Any, *, every_rank: bool) -> None:
    """Raise on every rank of ``group`` the first refusal of a probe write to ``hot`` (module
    docstring); do nothing for a tier that is not local."""
    if not isinstance(hot.backend, LocalBackend):
        return  # the same on every rank: the URL is
    rank, size = _dist.group_rank_world(group)
    refusal = probe(hot) if every_rank or rank == 0 else None
    if _dist.initialized() and size > 1:
        refusal = _first(refusal, group, rank, size)
    if refusal is not None:
        raise refusal


def probe(hot: Tier) -> StorageError | None:
    """Publish and delete one small object under ``hot``'s root; the refusal, if any."""
    backend = hot.backend
    assert isinstance(backend, LocalBackend)
    # The clock probe's key: short-lived, and gc deletes one a crash left (layout.KeyKind).
    key = layout.clock_probe_key(uuid.uuid4().hex)
    try:
        backend.publish(key, b"{}")
        backend.delete(key)
    except NoSpaceLeft as err:
        log.warning("%s is full now (%s): the first save prunes by retention or fails", hot.label, err)
    except StorageError as err:
        cause = err.__cause__
        code = cause.errno if isinstance(cause, OSError) else None
        if code in _REFUSED:
            return StorageError(_refused(code, backend.root), tier=hot.label, rank=_dist.rank_world()[0])
        log.warning("could not write a probe to %s when the manager was built: %s", hot.label, err)
    return None


def _refused(code: int | None, root: str) -> str:
    if code == errno.EROFS:
        what = f"{root} is on a read-only file system"
        fix = "remount it read-write"
    else:
        user = os.geteuid() if hasattr(os, "geteuid") else "this user"
        what = f"permission denied: user {user} cannot create files under {root}"
        fix = "give this user write access to it"
    return (
        f"the hot tier cannot be written: {what} ({errno.errorcode.get(code or 0, '?')}), so no "
        f"checkpoint could be saved there; {fix}, or give CheckpointManager another hot directory"
    )


def _first(refusal: StorageError | None, group: Any, rank: int, size: int) -> StorageError | None:
    """The refusal of the lowest rank of ``group`` that had one, on every rank of it."""
    import torch.distributed as dist

    # A group given to the manager may be NCCL's, whose collectives take CUDA tensors only.
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    lowest = torch.tensor([rank if refusal is not None else size], dtype=torch.int64, device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    source = int(lowest.item())
    if source == size:
        return None
    box = [refusal]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(group, source) if group is not None else source, group=group
    )
    return box[0]
