"""A data order that resumes mid-epoch without replaying or skipping a sample.

Every epoch has one global order: a permutation of ``range(size)`` drawn from ``(seed,
epoch)``. The state is where the run stands in it: ``epoch`` and ``position``, the number of
samples of that order consumed by all ranks together. Rank ``r`` of ``world`` ranks consumes
``order[position + r]``, then ``order[position + world + r]``, and so on; each round of
``world`` samples advances ``position`` by ``world``. An epoch gives every rank the same number
of samples (ranks step in lockstep): the last ``(size - position) % world`` samples of the
order, fewer than one round, are left out of that epoch, as ``DistributedSampler(drop_last=True)``
does.

Because the position is global and every rank holds the same value, the state is the same on
every rank (DCP saves one copy) and a resume under another world size is well defined: the new
ranks continue at the same global position, each taking every ``world``-th sample from there.
Nothing before the position is seen again in that epoch and nothing after it is skipped.

::

    sampler = ResumableSampler(len(dataset), seed=1234)           # rank and world from dist
    loader = ResumableLoader(dataset, batch_size=8, sampler=sampler)
    state = {"train": TrainingState(model, optim, sampler=loader)}
    manager.load_latest(state)                                    # restores epoch and position
    for batch in loader.endless():                                # epochs roll over by themselves
        ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tierstore._dist import rank_world
from tierstore.errors import ConfigError

__all__ = ["ResumableSampler", "ResumableLoader", "epoch_order", "rank_indices"]

log = logging.getLogger(__name__)


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of ``range(size)`` for ``epoch``: the same on every rank and world size."""
    if not shuffle:
        return list(range(size))
    import torch

    generator = torch.Generator().manual_seed(_mix(seed, epoch))
    return [int(i) for i in torch.randperm(size, generator=generator).tolist()]


def _mix(seed: int, epoch: int) -> int:
    # One generator seed per (seed, epoch); splitmix64-style so neighbouring epochs differ.
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def rank_indices(order: Sequence[int], position: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s samples of ``order`` from global ``position`` to the end of the epoch."""
    rounds = max(0, len(order) - position) // world
    return [order[position + k * world + rank] for k in range(rounds)]


class ResumableSampler:
    """This rank's share of a seeded, sharded epoch order, resumable mid-epoch (a DCP ``Stateful``).

    Args:
        size: number of samples in the dataset.
        rank, world_size: the data-parallel rank and size; default from ``torch.distributed``.
        seed: shuffle seed; the order of epoch ``e`` depends only on ``(seed, e)``.
        shuffle: ``False`` walks ``range(size)`` in order.

    Iterating yields this rank's remaining indices of the current epoch and counts each as
    consumed when it is handed out, which is exact for a consumer that takes one index at a
    time (``DataLoader(num_workers=0)``). Loaders that prefetch run ahead of training: use
    :class:`ResumableLoader`, which counts batches as they reach the training loop.

    ``set_epoch(e)`` with the epoch already current keeps the position, so the usual
    ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch); ...`` loop resumes
    mid-epoch.
    """

    def __init__(
        self,
        size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if size < 0:
            raise ConfigError(f"size must not be negative, got {size}")
        dist_rank, dist_world = rank_world()
        self.size = size
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) of the current epoch

    # -- the order --------------------------------------------------------------------------

    def order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.size, self.seed, self.epoch, self.shuffle))
        return self._order[1]

    def pending(self) -> list[int]:
        """This rank's indices not yet consumed in the current epoch."""
        return rank_indices(self.order(), self.position, self.rank, self.world_size)

    def __len__(self) -> int:
        return max(0, self.size - self.position) // self.world_size

    def advance(self, count: int) -> None:
        """Record that every rank consumed ``count`` more samples (one per round)."""
        if count < 0 or count > len(self):
            raise ConfigError(f"cannot advance {count} samples: {len(self)} left in epoch {self.epoch}")
        self.position += count * self.world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[int]:
        for index in self.pending():
            self.advance(1)  # counted before it is handed out: a save after using it includes it
            yield index

    # -- Stateful ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # Plain ints, the same on every rank: DCP keeps one copy (see the module docstring).
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "size": self.size,
            "shuffle": int(self.shuffle),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["size"]) != self.size:
            raise ConfigError(
                f"the checkpoint's data position is for a dataset of {state['size']} "
                f"samples, this one has {self.size}: the epoch order would differ"
            )
        if int(state["seed"]) != self.seed or bool(state["shuffle"]) != self.shuffle:
            log.warning(
                "sampler seed/shuffle %s/%s from the checkpoint replace %s/%s",
                state["seed"],
                bool(state["shuffle"]),
                self.seed,
                self.shuffle,
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        saved_world = int(state["world_size"])
        if saved_world != self.world_size:
            log.warning(
                "data position: saved by %d ranks, resuming on %d at global sample %d of "
                "epoch %d (no sample replayed or skipped)",
                saved_world,
                self.world_size,
                self.position,
                self.epoch,
            )


class ResumableLoader:
    """Batches of this rank's samples in :class:`ResumableSampler` order (a DCP ``Stateful``).

    A ``torch.utils.data.DataLoader`` fetches the batches (``num_workers`` and the rest of
    ``loader_options`` apply); the position advances only when a batch reaches the caller, so
    prefetching never makes a checkpoint skip data. One iteration is the rest of the current
    epoch; :meth:`endless` rolls over into the next epochs.

    Each iteration gives its DataLoader a generator of its own, seeded from ``(seed, epoch,
    position)``, so starting an iteration never draws from the global torch RNG (that would
    shift every later random draw of a resumed run). Workers' own random streams restart
    from that seed at a resume; derive per-sample randomness from the sample index when it
    must be exact across a resume.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        sampler: ResumableSampler,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_options: Any,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.collate_fn = collate_fn
        self.loader_options = loader_options

    def __iter__(self) -> Iterator[Any]:
        import torch
        from torch.utils.data import DataLoader

        pending = self.sampler.pending()
        batches = [pending[i : i + self.batch_size] for i in range(0, len(pending), self.batch_size)]
        options = dict(self.loader_options)
        # A DataLoader iterator draws its workers' base seed from the global torch RNG unless
        # given a generator: a resumed run, which builds its iterator at another moment than
        # the uninterrupted one, would then see different dropout masks from then on.
        options.setdefault(
            "generator",
            torch.Generator().manual_seed(
                _mix(self.sampler.seed, self.sampler.epoch) ^ self.sampler.position
            ),
        )
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, **options)
        for indices, batch in zip(batches, loader):
            self.sampler.advance(len(indices))
            yield batch

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def endless(self) -> Iterator[Any]:
        """Batches forever: at the end of an epoch, the next epoch's order begins."""
        if self.sampler.size < self.sampler.world_size:
            raise ConfigError(f"{self.sampler.size} samples cannot feed {self.sampler.world_size} ranks")
        while True:
            yield from self
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
