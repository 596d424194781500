"""Staging that is paid once: the copy of the state a ``CheckpointManager`` saves from.

An async save first copies the state (the "staging" copy), so training can go on while the
copy is written. DCP's default for ``async_save`` allocates fresh buffers for that copy on
every save; allocating and first-touching them costs several times the copy itself
(docs/operations.md, "Staging and stalls"). :class:`ReusedStaging` keeps them instead: it
wraps DCP's ``DefaultStager``, whose ``StateDictStager`` caches one staging storage per source
storage and refills it with ``copy_`` on the next save. A tensor whose storage changed (a new
key, a new shape, a parameter replaced) gets a new buffer; the one it replaced is freed with its
source. Nothing else is cached: the state is walked again on every save.

Only one save may use a stager at a time: the manager starts a save after the previous one
finished, and the writer reads the staged buffers until then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["AlreadyStaged", "ReusedStaging", "resolve_stateful", "staging_options"]

log = logging.getLogger(__name__)


def staging_options(async_mode: str, *, background: bool = True) -> StagingOptions:
    """The options this machine supports: pinned buffers and non-blocking copies need an
    accelerator (they fail on a CPU-only build), shared memory spares PROCESS mode a copy into
    shared memory when the staged state is handed to the checkpoint process. ``background``:
    the copy runs on the stager's own thread (``stage()`` returns a future); otherwise on the
    caller's, which waits for it (and, after non-blocking device copies, for the device)."""
    return StagingOptions(
        use_pinned_memory=torch.cuda.is_available(),
        use_shared_memory=async_mode == "process",
        use_async_staging=background,
        use_non_blocking_copy=torch.accelerator.is_available(),
    )


class AlreadyStaged(AsyncStager):
    """The stager of a save whose state is already a staged copy: ``stage()`` hands it on as
    it is. The manager copies the state on the caller's thread with a :class:`ReusedStaging`
    and starts DCP's save of the copy on a thread of its own with this."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def resolve_stateful(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP's save does to the state first (``_stateful_to_state_dict``): a shallow copy
    with each top-level ``Stateful`` replaced by its ``state_dict()``; without DCP's logging
    of every entry, and with tensors (no ``state_dict`` method) spared the ``Stateful``
    protocol check, which costs more than the copy of a small tensor."""
    return {
        key: value
        if isinstance(value, torch.Tensor) or not isinstance(value, Stateful)
        else value.state_dict()
        for key, value in state.items()
    }


class ReusedStaging(AsyncStager):
    """An ``AsyncStager`` whose buffers outlive each save; :meth:`close` frees them.

    ``new_bytes`` is what the latest :meth:`stage` allocated: the whole state on the first save
    and after the structure changed, zero while it stays the same.
    """

    _synchronize_after_execute = False  # stage() returns a future: async_save hands it on

    def __init__(self, options: StagingOptions) -> None:
        self.options = options
        self.new_bytes = 0
        self._stager = DefaultStager(options)
        # Staging storages handed out so far, by identity; they vanish with DCP's cache entry.
        self._buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]] | dict[str, Any]:
        self.new_bytes = 0  # stays 0 if this staging fails
        staged = self._stager.stage(state_dict)
        if not isinstance(staged, Future):
            self._count(staged)
            return staged
        # Counted before the save may read the copy: the manager reads new_bytes once the
        # save settled, and the next stage() starts only after that.
        counted: Future[dict[str, Any]] = Future()

        def done(future: Future[dict[str, Any]]) -> None:
            try:
                result = future.result()
                self._count(result)
            except BaseException as err:  # handed to the save, which reports it
                counted.set_exception(err)
            else:
                counted.set_result(result)

        staged.add_done_callback(done)
        return counted

    def _count(self, staged: dict[str, Any]) -> None:
        new = 0
        for tensor in _tensors(staged):
            storage = tensor.untyped_storage()
            if storage not in self._buffers:
                self._buffers[storage] = None
                new += storage.nbytes()
        self.new_bytes = new
        if new:
            log.info("staging allocated %d bytes (first save, or the state's structure changed)", new)

    def synchronize_staging(self) -> None:
        """Nothing to wait for here: callers wait on the future :meth:`stage` returns."""
        return None

    def close(self) -> None:
        self._stager.close()
        self._buffers.clear()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
