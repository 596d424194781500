"""Retention policies and the prune plan: pure, composable, and never unsafe."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore.lifecycle.prune import plan_prune
from tierstore.lifecycle.retention import (
    keep_all,
    keep_every,
    keep_last,
    keep_none,
    keep_steps,
    keep_within,
    within_run,
)


@dataclass(frozen=True)
class Ckpt:
    name: str
    step: int | None
    created: float


def ckpts(*steps: int) -> list[Ckpt]:
    return [Ckpt(f"step-{s:010d}", s, 1000.0 + s) for s in steps]


def names(found) -> set[int]:
    return {int(n.split("-")[1]) for n in found}


@dataclass(frozen=True)
class RunCkpt(Ckpt):
    run: str | None = None


def test_within_run_counts_and_prunes_only_that_runs_checkpoints() -> None:
    mine = [RunCkpt(f"step-{s:010d}", s, 1000.0 + s, "B") for s in (11, 12, 13)]
    others = [RunCkpt(f"step-{s:010d}", s, 1000.0 + s, run) for s, run in ((1, "A"), (2, None), (20, "A"))]
    plain = Ckpt("step-0000000030", 30, 1030.0)  # a checkpoint type without a run
    everything = [*others, *mine, plain]
    assert names(within_run("B", keep_last(1)).keep(everything, now=0)) == {1, 2, 20, 30, 13}
    assert names(within_run("B", keep_none()).keep(everything, now=0)) == {1, 2, 20, 30}
    assert names(keep_last(1).keep(everything, now=0)) == {30}  # unscoped: every run's counts


def test_basic_policies() -> None:
    c = ckpts(5, 10, 15, 20, 25)
    assert names(keep_last(2).keep(c, now=0)) == {20, 25}
    assert names(keep_every(10).keep(c, now=0)) == {10, 20}
    assert names(keep_steps(5, 99).keep(c, now=0)) == {5}
    assert names(keep_within(12).keep(c, now=1025)) == {15, 20, 25}
    assert names(keep_within(timedelta(seconds=12)).keep(c, now=1025)) == {15, 20, 25}
    assert names((keep_last(1) | keep_every(10) | keep_steps(5)).keep(c, now=0)) == {5, 10, 20, 25}
    assert keep_all().keep(c, now=0) == {x.name for x in c} and keep_none().keep(c, now=0) == frozenset()
    for bad in (lambda: keep_last(-1), lambda: keep_every(0), lambda: keep_within(-1)):
        with pytest.raises(ValueError):
            bad()


POLICIES = st.recursive(
    st.one_of(
        st.builds(keep_last, st.integers(0, 6)),
        st.builds(keep_every, st.integers(1, 50)),
        st.builds(lambda s: keep_steps(*s), st.lists(st.integers(0, 200), max_size=4)),
        st.builds(keep_within, st.floats(0, 500)),
        st.just(keep_none()),
    ),
    lambda inner: st.builds(lambda a, b: a | b, inner, inner),
    max_leaves=4,
)
CATALOGS = st.lists(
    st.builds(
        Ckpt,
        name=st.text("abcdefgh", min_size=1, max_size=6),
        step=st.one_of(st.none(), st.integers(0, 200)),
        created=st.floats(0, 1000),
    ),
    max_size=15,
    unique_by=lambda c: c.name,
)


@given(policy=POLICIES, catalog=CATALOGS, data=st.data())
def test_prune_plan_is_safe_and_deterministic(policy, catalog, data) -> None:
    now = data.draw(st.floats(0, 2000))
    pending = (
        set(data.draw(st.lists(st.sampled_from([c.name for c in catalog]), unique=True)))
        if catalog
        else set()
    )
    doomed, kept, protected = plan_prune(catalog, policy, protect=pending, now=now)
    doomed_names = {m.name for m in doomed}
    if catalog:
        newest = max(catalog, key=lambda c: (-1 if c.step is None else c.step, c.created, c.name))
        assert newest.name not in doomed_names  # never the newest committed
    assert not doomed_names & pending  # never a pending migration
    assert doomed_names | kept == {c.name for c in catalog} and not doomed_names & kept
    assert policy.keep(catalog, now=now) <= kept  # everything the policy wants survives
    assert protected <= kept and not protected & policy.keep(catalog, now=now)
    again = plan_prune(list(reversed(catalog)), policy, protect=pending, now=now)
    assert ([m.name for m in again[0]], again[1]) == ([m.name for m in doomed], kept)  # deterministic
    steps = [(-1 if m.step is None else m.step, m.created) for m in doomed]
    assert steps == sorted(steps)  # oldest first


@given(catalog=CATALOGS, n=st.integers(0, 5), k=st.integers(1, 20))
def test_union_keeps_what_either_keeps(catalog, n, k) -> None:
    a, b = keep_last(n), keep_every(k)
    assert (a | b).keep(catalog, now=0) == a.keep(catalog, now=0) | b.keep(catalog, now=0)
