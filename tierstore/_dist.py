"""This process's place in a ``torch.distributed`` job: the one rank/world helper, and the
few collectives tierstore makes.

Without an initialized default process group a process is rank 0 of a world of 1. Nothing
here imports ``torch.distributed``: a process group can only exist if something imported it
already, so modules usable without it (``resume.data``, ``resume.cadence``) stay light.

Object collectives run on whatever the group is made of: gloo on the CPU, NCCL on the CUDA
device current on each rank (torch's rule for object collectives; a job using NCCL sets it
with ``torch.cuda.set_device``, as it must for DCP itself). ``group=None`` is the default group.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "initialized",
    "rank_world",
    "group_rank_world",
    "broadcast",
    "all_gather",
    "barrier",
    "Failure",
    "job_id",
]

# Asked in this order: torchrun's run id first (it runs under any scheduler, and its
# rendezvous names the job by it), then the batch schedulers' job ids.
_JOB_VARIABLES = (
    ("TORCHELASTIC_RUN_ID", "torchrun run"),
    ("SLURM_JOB_ID", "slurm job"),
    ("PBS_JOBID", "pbs job"),
    ("LSB_JOBID", "lsf job"),
)


def job_id() -> str | None:
    """This process's job as its launcher or scheduler names it (``"torchrun run 5f3a"``,
    ``"slurm job 4242"``), or ``None`` outside one. torchrun's ``none`` (its default when no
    ``--rdzv-id`` is given) names nothing. For display only (the run lock's label, a
    manifest's ``job``): a job submitted again gets a new id, so no decision rests on it."""
    for variable, what in _JOB_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value and value.lower() != "none":
            return f"{what} {value}"
    return None


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


def group_rank_world(group: Any) -> tuple[int, int]:
    """``(rank, size)`` within ``group``; ``(0, 1)`` outside a distributed job."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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


def barrier(group: Any) -> None:
    """Wait until every rank of ``group`` got here (nothing to wait for when not distributed)."""
    dist = _dist()
    if dist is not None:
        dist.barrier(group=group)


@dataclass(frozen=True)
class Failure:
    """One rank's error, sent to the others so they raise it too (never hang waiting).

    The error itself crosses when it pickles and unpickles (every
    :class:`~tierstore.errors.TierstoreError` does, attributes included); otherwise a
    ``RuntimeError`` naming its type and message stands in for it.
    """

    error: BaseException | None
    kind: str
    message: str

    @classmethod
    def of(cls, err: BaseException) -> Failure:
        try:
            pickle.loads(pickle.dumps(err))  # what the receivers will do: fail here, not there
            kept: BaseException | None = err
        except Exception:
            kept = None
        return cls(kept, type(err).__name__, str(err))

    def rebuild(self) -> BaseException:
        """The error to raise on this rank: a copy of the sender's (without its traceback)."""
        if self.error is not None:
            return self.error
        return RuntimeError(f"{self.kind}: {self.message}")
