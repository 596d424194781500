"""``TrainingState``'s arguments, checked when it is built: what a save would call on each of
them, and what to write instead, said then and not at the first save, ``save_every`` steps in
(issue 38: a plain ``DataLoader`` as ``sampler=`` failed only there, with an
``AttributeError``).

Each argument is checked only where its part is saved (``exclude`` leaves it unused), and by
what a save and a load call on it, never by its type alone: a torchdata
``StatefulDataLoader`` or a ``KeyedOptimizer`` passes as it did.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from tierstore.errors import ConfigError

__all__ = ["check_arguments"]

_STATEFUL = "an object with state_dict() and load_state_dict()"
_DATA = (
    "the data position: a tierstore ResumableLoader or ResumableSampler, or "
    f"{_STATEFUL} whose state is the same on every rank, or None to save no data position"
)


def check_arguments(
    saved: Collection[str],
    model: Any,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    extra: Any,
    options: Any,
) -> None:
    """Raise :class:`ConfigError` for the first argument a save or load of ``saved`` parts
    could not use, naming it, the type given, what it takes and what to write instead."""
    if {"model", "optim"} & set(saved) and not isinstance(model, nn.Module):
        _refuse("model", model, "a torch.nn.Module (FSDP2-sharded or not)", needs=())
    if "optim" in saved and optimizer is not None:
        _check_optimizer(optimizer)
    if "scheduler" in saved and scheduler is not None and _missing(scheduler):
        _refuse("scheduler", scheduler, f"an LR scheduler, or {_STATEFUL}, or None")
    if "data" in saved and sampler is not None and _missing(sampler):
        _refuse("sampler", sampler, _DATA, _data_instead(sampler))
    if "extra" in saved and extra is not None:
        _check_extra(extra)
    if options is not None and not isinstance(options, StateDictOptions):
        _refuse(
            "options",
            options,
            "torch's StateDictOptions (torch.distributed.checkpoint.state_dict), or None",
            needs=(),
        )


_PROTOCOL = ("state_dict", "load_state_dict")


def _missing(obj: Any, names: tuple[str, ...] = _PROTOCOL) -> list[str]:
    return [name for name in names if not callable(getattr(obj, name, None))]


def _kind(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _refuse(
    argument: str, given: Any, takes: str, instead: str = "", *, needs: tuple[str, ...] = _PROTOCOL
) -> None:
    lacks = [name for name in needs if not hasattr(given, name)]
    why = f" (it has no {' and no '.join(lacks)})" if lacks else ""
    raise ConfigError(
        f"TrainingState({argument}=...) takes {takes}; got {_kind(given)}{why}"
        + (f". {instead}." if instead else "")
    )


def _check_optimizer(optimizer: Any) -> None:
    # get_state_dict takes one optimizer or several; it reads param_groups and state.
    takes = (
        "a torch.optim.Optimizer (anything with param_groups, state_dict() and "
        "load_state_dict()), a list or tuple of them, or None"
    )
    each = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for one in each:
        needs = ("param_groups", *_PROTOCOL)
        if _missing(one) or not hasattr(one, "param_groups"):
            instead = ""
            if hasattr(one, "optimizer") and callable(getattr(one, "step", None)):
                instead = "The LR scheduler goes third: TrainingState(model, optimizer, scheduler)"
            _refuse("optimizer", one, takes, instead, needs=needs)


def _check_extra(extra: Any) -> None:
    if not isinstance(extra, Mapping):
        _refuse("extra", extra, f'a mapping of names to {_STATEFUL}, e.g. extra={{"ema": ema}}', needs=())
    for name, obj in extra.items():
        if not isinstance(name, str):
            raise ConfigError(f"TrainingState(extra=...): names must be strings; got {name!r}")
        if _missing(obj):
            _refuse(f"extra[{name!r}]", obj, f"{_STATEFUL} whose state is the same on every rank")


def _data_instead(sampler: Any) -> str:
    """What to pass instead of a data object that keeps no position (a DataLoader, a Sampler)."""
    from torch.utils.data import DataLoader, Sampler

    if isinstance(sampler, DataLoader):
        batch = sampler.batch_size if isinstance(sampler.batch_size, int) else 8
        return (
            "A DataLoader keeps no position to save or restore: build the loader as "
            f"ResumableLoader(dataset, batch_size={batch}, sampler=ResumableSampler(len(dataset), "
            "seed=...)) (DataLoader keywords such as num_workers pass through) and give it "
            "both to the training loop and as sampler="
        )
    if isinstance(sampler, Sampler):
        return (
            f"A {type(sampler).__name__} keeps no position to save or restore: use "
            "ResumableSampler(len(dataset), seed=...) in its place (rank and world size from "
            "torch.distributed), ideally inside a ResumableLoader, and pass that"
        )
    return ""
