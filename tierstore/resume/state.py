"""Everything a resume needs, as one DCP ``Stateful``: model, optimizer, scheduler, step, RNG, data.

::

    train = TrainingState(model, optim, scheduler, sampler=loader, seed=1234)
    manager.load_latest({"train": train})          # restores every part; train.step is the step
    for step in range(train.step + 1, total + 1):
        ...                                        # one training step
        train.step = step
        manager.save(step, {"train": train})

What is saved, under the key the state is given (``train`` above):

``model``, ``optim``
    ``torch.distributed.checkpoint.state_dict.get_state_dict``: sharded (DTensor) for FSDP2,
    so each rank writes its own shard and a load reshards as DCP does.
``scheduler``, ``step``, ``data``
    The LR scheduler's ``state_dict()``, the step counter, and the sampler/loader position.
    They are the same on every rank; DCP keeps one copy.
``rng``
    Each rank's own generator states (Python ``random``, NumPy's global generator, torch CPU
    and the current CUDA device) as tensors under ``rng.rank<r>``, plus ``rng.world_size``.
    DCP de-duplicates keys that several ranks save, keeping one rank's value, so per-rank
    values need per-rank keys. On load rank ``r`` takes back ``rng.rank<r>`` when the world
    size is the one saved; under another world size there is no stream that "continues" a
    rank, and every rank is reseeded from ``(seed, step, rank)`` instead (deterministic, and
    logged). Load with :class:`ResumePlanner` when the world size may have grown, since the
    new ranks' keys are absent from the checkpoint.

``exclude=("rng",)`` (or any of :data:`PARTS`) leaves a part out of both save and load.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from tierstore._dist import rank_world
from tierstore.errors import ConfigError
from tierstore.resume._arguments import check_arguments

__all__ = [
    "TrainingState",
    "ResumePlanner",
    "PARTS",
    "capture_rng",
    "restore_rng",
    "reseed",
    "is_per_rank_key",
]

log = logging.getLogger(__name__)

PARTS = ("model", "optim", "scheduler", "step", "rng", "data", "extra")

_PER_RANK = re.compile(r"(^|\.)rng\.rank\d+(\.|$)")


class StatefulLike(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any) -> Any: ...


class TrainingState:
    """The whole training state as one DCP ``Stateful`` (see the module docstring).

    Args:
        model: the (possibly FSDP2-sharded) model.
        optimizer: its optimizer, or ``None``.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        sampler: the data position: a :class:`tierstore.resume.data.ResumableSampler` or
            :class:`~tierstore.resume.data.ResumableLoader`, or any ``Stateful`` whose state is the
            same on every rank. A plain ``DataLoader`` or ``Sampler`` keeps no position and is
            refused.
        step: the step counter; set ``state.step`` after each step.
        seed: base seed for reseeding the RNG after a change of world size.
        extra: more ``Stateful`` objects whose state is the same on every rank.
        exclude: parts (of :data:`PARTS`) to leave out of the checkpoint and of the load.
        options: ``StateDictOptions`` for the model and optimizer state dicts.

    Every argument whose part is saved is checked here, by what a save and a load call on it:
    one they could not use raises :class:`~tierstore.errors.ConfigError` now, naming it and
    what to pass instead, not at the first save.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: StatefulLike | None = None,
        sampler: StatefulLike | None = None,
        *,
        step: int = 0,
        seed: int = 0,
        extra: Mapping[str, StatefulLike] | None = None,
        exclude: Iterable[str] = (),
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.step = step
        self.seed = seed
        if isinstance(exclude, str):  # frozenset("rng") would be {"r", "n", "g"}
            raise ConfigError(f"exclude takes a collection of parts, e.g. exclude=({exclude!r},)")
        self.exclude = frozenset(exclude)
        unknown = self.exclude - set(PARTS)
        if unknown:
            raise ConfigError(f"unknown parts to exclude {sorted(unknown)}; parts are {PARTS}")
        saved = set(PARTS) - self.exclude
        check_arguments(saved, model, optimizer, scheduler, sampler, extra, options)
        self.extra = dict(extra or {})
        self.options = options

    def _has(self, part: str) -> bool:
        present = {
            "model": True,
            "optim": self.optimizer is not None,
            "scheduler": self.scheduler is not None,
            "data": self.sampler is not None,
            "extra": bool(self.extra),
        }
        return part not in self.exclude and present.get(part, True)

    # -- Stateful ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        state.update(self._model_and_optim())
        if self._has("scheduler"):
            assert self.scheduler is not None
            state["scheduler"] = self.scheduler.state_dict()
        if self._has("step"):
            state["step"] = self.step
        if self._has("rng"):
            rank, world = rank_world()
            state["rng"] = {"world_size": world, f"rank{rank}": capture_rng()}
        if self._has("data"):
            assert self.sampler is not None
            state["data"] = self.sampler.state_dict()
        if self._has("extra"):
            state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return state

    def _model_and_optim(self) -> dict[str, Any]:
        model, optim = self._has("model"), self._has("optim")
        if model and optim:
            assert self.optimizer is not None
            msd, osd = get_state_dict(self.model, self.optimizer, options=self.options)
            return {"model": msd, "optim": osd}
        if model:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        if optim:
            assert self.optimizer is not None
            return {"optim": get_optimizer_state_dict(self.model, self.optimizer, options=self.options)}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_model_and_optim(state)
        if self._has("scheduler"):
            assert self.scheduler is not None
            self.scheduler.load_state_dict(state["scheduler"])
        if self._has("step"):
            self.step = int(state["step"])
        if self._has("data"):
            assert self.sampler is not None
            self.sampler.load_state_dict(state["data"])
        for name, obj in self.extra.items() if self._has("extra") else ():
            obj.load_state_dict(state["extra"][name])
        if self._has("rng"):  # last: nothing after it may draw from the restored streams
            self._load_rng(state["rng"])

    def _load_model_and_optim(self, state: dict[str, Any]) -> None:
        model, optim = self._has("model"), self._has("optim")
        if model and optim:
            assert self.optimizer is not None
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=self.options,
            )
        elif model:
            set_model_state_dict(self.model, state["model"], options=self.options)
        elif optim:
            assert self.optimizer is not None
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.options)

    def _load_rng(self, rng: dict[str, Any]) -> None:
        rank, world = rank_world()
        saved_world = int(rng["world_size"])
        if saved_world == world:
            restore_rng(rng[f"rank{rank}"])
            return
        log.warning(
            "RNG state was saved by %d ranks, resuming on %d: per-rank streams cannot "
            "continue, reseeding rank %d from (seed %d, step %d, rank)",
            saved_world,
            world,
            rank,
            self.seed,
            self.step,
        )
        reseed(self.seed, self.step, rank)


# -- RNG as tensors: no pickle of our own, and DCP saves tensors as plain bytes ---------------


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generator states (Python, NumPy if installed, torch CPU, CUDA if present)."""
    version, words, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
    }
    numpy = _numpy()
    if numpy is not None:
        _, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = torch.from_numpy(keys.astype("int64"))
        state["numpy_meta"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: Mapping[str, torch.Tensor]) -> None:
    """Set this process's generators to ``state`` (as made by :func:`capture_rng`)."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    python = [int(x) for x in state["python"].tolist()]
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        pos, has_gauss_np, cached = state["numpy_meta"].tolist()
        keys = state["numpy"].numpy().astype("uint32")
        numpy.random.set_state(("MT19937", keys, int(pos), int(has_gauss_np), cached))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every generator from ``(seed, step, rank)``: distinct per rank, the same every run."""
    digest = hashlib.sha256(f"tierstore:{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF
    random.seed(value)
    torch.manual_seed(value)  # also every CUDA device
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(value % 2**32)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional: its generator is then not part of the state
        return None
    return numpy


# -- loading when keys may be absent ----------------------------------------------------------


def is_per_rank_key(key: str) -> bool:
    """Whether a flattened state key is one rank's own (``...rng.rank<r>...``)."""
    return _PER_RANK.search(key) is not None


class ResumePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that keys ``optional(key)`` accepts may be absent.

    Absent optional keys are left as they are in the state being loaded into and listed in
    :attr:`missing`. By default only per-rank RNG keys are optional, which is what a load
    under a larger world size needs; every other key stays strict.
    """

    def __init__(self, optional: Callable[[str], bool] = is_per_rank_key, **options: Any) -> None:
        super().__init__(**options)
        self.optional = optional
        self.missing: list[str] = []

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner runs first"
        present = self.metadata.state_dict_metadata
        self.missing = sorted(k for k in self.state_dict if k not in present and self.optional(k))
        for key in self.missing:
            del self.state_dict[key]
        return super().create_local_plan()
