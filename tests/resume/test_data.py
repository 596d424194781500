"""ResumableSampler / ResumableLoader: no sample replayed or skipped across a resume."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import ConfigError
from tierstore.resume.data import ResumableLoader, ResumableSampler, epoch_order


def stream(sampler: ResumableSampler) -> Iterator[tuple[int, int]]:
    """(epoch, index) forever, rolling over epochs as a training loop does."""
    while True:
        for index in sampler:
            yield sampler.epoch, index
        sampler.set_epoch(sampler.epoch + 1)


def run_phase(
    state: dict[str, int] | None, size: int, seed: int, world: int, rounds: int
) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """``world`` ranks resume from ``state`` and consume ``rounds`` samples each, in lockstep."""
    samplers = [ResumableSampler(size, rank=r, world_size=world, seed=seed) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    streams = [stream(s) for s in samplers]
    consumed = [next(it) for _ in range(rounds) for it in streams]
    states = [s.state_dict() for s in samplers]
    assert all(s == states[0] for s in states), "every rank must hold the same data position"
    return consumed, states[0]


phases = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 40)), min_size=2, max_size=4)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(6, 120), seed=st.integers(0, 2**31), phases=phases)
def test_no_sample_replayed_or_skipped_across_resumes(
    size: int, seed: int, phases: list[tuple[int, int]]
) -> None:
    """Stop after random numbers of rounds, resume under random world sizes, repeat."""
    consumed: list[tuple[int, int]] = []
    state = None
    ends: dict[int, int] = {}  # epoch -> world size of the phase that was running when it ended
    for world, rounds in phases:
        got, state = run_phase(state, size, seed, world, rounds)
        for epoch, _ in got:
            ends.setdefault(epoch - 1, world)
        consumed += got
    assert state is not None
    for epoch in sorted({e for e, _ in consumed}):
        seen = [i for e, i in consumed if e == epoch]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was replayed"
        order = epoch_order(size, seed, epoch)
        assert sorted(seen) == sorted(order[: len(seen)]), f"epoch {epoch}: a sample was skipped"
        if epoch < state["epoch"]:  # a finished epoch left out less than one round
            assert size - len(seen) < ends[epoch], (epoch, size, len(seen))
    assert state["position"] == len([1 for e, _ in consumed if e == state["epoch"]])


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(4, 80),
    seed=st.integers(0, 2**31),
    world=st.integers(1, 4),
    stops=st.lists(st.integers(0, 30), min_size=1, max_size=3),
)
def test_same_world_size_resume_gives_every_rank_the_uninterrupted_sequence(
    size: int, seed: int, world: int, stops: list[int]
) -> None:
    size = max(size, world)
    total = sum(stops) + 7
    uninterrupted, _ = run_phase(None, size, seed, world, total)
    resumed: list[tuple[int, int]] = []
    state = None
    for rounds in [*stops, total - sum(stops)]:
        got, state = run_phase(state, size, seed, world, rounds)
        resumed += got
    assert resumed == uninterrupted


def test_epoch_order_depends_on_seed_and_epoch_only() -> None:
    assert epoch_order(50, 1, 0) == epoch_order(50, 1, 0)
    assert epoch_order(50, 1, 0) != epoch_order(50, 1, 1)
    assert epoch_order(50, 1, 0) != epoch_order(50, 2, 0)
    assert sorted(epoch_order(50, 1, 3)) == list(range(50))
    assert epoch_order(5, 1, 0, shuffle=False) == [0, 1, 2, 3, 4]


def test_set_epoch_to_the_current_epoch_keeps_the_position() -> None:
    sampler = ResumableSampler(20, rank=0, world_size=2, seed=3)
    sampler.advance(4)
    sampler.set_epoch(0)
    assert sampler.position == 8
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.position) == (1, 0)


def test_a_different_dataset_size_is_refused() -> None:
    state = ResumableSampler(20, rank=0, world_size=1).state_dict()
    with pytest.raises(ConfigError, match="20 samples"):
        ResumableSampler(21, rank=0, world_size=1).load_state_dict(state)


def test_loader_counts_batches_delivered_not_prefetched() -> None:
    data = torch.arange(40).unsqueeze(1)
    sampler = ResumableSampler(40, rank=1, world_size=2, seed=5)
    loader = ResumableLoader(data, 3, sampler, num_workers=1, prefetch_factor=4)
    it = iter(loader)
    first, second = next(it), next(it)
    assert sampler.position == 2 * 3 * 2  # two batches of 3, for each of 2 ranks
    resumed = ResumableSampler(40, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(loader.state_dict())
    rest = torch.cat(list(ResumableLoader(data, 3, resumed)))
    everything = torch.cat([first, second, rest]).flatten().tolist()
    assert everything == sampler.order()[1::2]  # rank 1's share, in order, each once


def test_starting_an_iteration_does_not_draw_from_the_global_rng() -> None:
    # DataLoader draws its workers' base seed from the global RNG unless given a generator; a
    # resumed run, which starts its iterator at another moment, would then diverge.
    loader = ResumableLoader(torch.arange(10), 2, ResumableSampler(10, rank=0, world_size=1))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


def test_endless_rolls_over_epochs() -> None:
    sampler = ResumableSampler(6, rank=0, world_size=2, seed=1)
    batches = ResumableLoader(torch.arange(6), 2, sampler).endless()
    got = [next(batches).tolist() for _ in range(4)]
    assert [len(b) for b in got] == [2, 1, 2, 1]  # 3 samples per rank per epoch
    assert got[2] + got[3] == sampler.order()[0::2] and sampler.epoch == 1
    assert got[0] + got[1] == epoch_order(6, 1, 0)[0::2]
