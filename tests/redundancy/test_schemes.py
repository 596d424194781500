"""Where copies on other nodes go (issue 37): ``Replicas`` and ``Parity`` refuse what they
cannot protect, place every copy on another node by rules every rank computes alike, and
``Topology`` numbers the nodes from torchrun's ``LOCAL_WORLD_SIZE`` or a node-id function."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import ConfigError
from tierstore.redundancy import Parity, Replicas, Topology

# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("copies", [1, 0, -2, True, 2.0, "2", None])
def test_replicas_refuses_fewer_than_two_copies_or_a_non_int(copies: object) -> None:
    with pytest.raises(ConfigError, match=r"Replicas\(copies\) needs an int of at least 2"):
        Replicas(copies)  # type: ignore[arg-type]


def test_replicas_survives_one_less_than_its_copies() -> None:
    assert Replicas().copies == 2 and Replicas().survives == 1
    assert Replicas(4).survives == 3 and Replicas(4).describe() == "Replicas(4)"


@pytest.mark.parametrize(
    ("k", "m", "what"),
    [(0, 1, "k"), (-1, 1, "k"), (True, 1, "k"), (2.0, 1, "k"), (2, 0, "m"), (2, False, "m"), (2, "1", "m")],
)
def test_parity_refuses_a_non_positive_or_non_int_k_or_m(k: object, m: object, what: str) -> None:
    with pytest.raises(ConfigError, match=rf"Parity\({what}\) needs a positive int"):
        Parity(k, m)  # type: ignore[arg-type]


def test_parity_refuses_more_than_256_blocks() -> None:
    with pytest.raises(ConfigError, match="k \\+ m is at most 256"):
        Parity(255, 2)
    with pytest.raises(ConfigError, match="k \\+ m is at most 256"):
        Parity(256, 1)
    assert Parity(255, 1).survives == 1  # 256 blocks is the most GF(2^8) has: allowed


@pytest.mark.parametrize(
    ("scheme", "topology", "needed"),
    [
        (Replicas(2), Topology(4, 4), 2),  # one node: a copy would land on its own node
        (Replicas(3), Topology(4, 2), 3),
        (Parity(2, 1), Topology(4, 2), 3),
        (Parity(3, 2), Topology(8, 2), 5),
    ],
)
def test_too_few_nodes_is_a_config_error_naming_what_is_needed(
    scheme: Replicas | Parity, topology: Topology, needed: int
) -> None:
    with pytest.raises(ConfigError, match=f"at least {needed} nodes") as info:
        scheme.check(topology)
    assert f"has {topology.nodes}" in str(info.value) and topology.describe() in str(info.value)
    # One node more than it lacks and it is fine.
    scheme.check(Topology(needed * topology.local_world, topology.local_world))


# -- Replicas placement ----------------------------------------------------------------------


@st.composite
def replica_layouts(draw: st.DrawFn) -> tuple[Replicas, Topology]:
    nodes = draw(st.integers(2, 12))
    local = draw(st.integers(1, 4))
    copies = draw(st.integers(2, nodes))
    return Replicas(copies), Topology(nodes * local, local)


@settings(max_examples=150, deadline=None)
@given(replica_layouts())
def test_replicas_go_to_other_nodes_at_the_same_local_index_spread_as_a_ring(
    layout: tuple[Replicas, Topology],
) -> None:
    scheme, topology = layout
    scheme.check(topology)
    received: Counter[int] = Counter()
    for rank in range(topology.world):
        targets = scheme.targets(rank, topology)
        nodes = [topology.node_of(t) for t in targets]
        assert len(targets) == scheme.copies - 1
        assert topology.node_of(rank) not in nodes  # never a copy on its own node
        assert len(set(nodes)) == len(nodes)  # each copy on a node of its own
        assert all(0 <= t < topology.world for t in targets)
        assert all(topology.local_of(t) == topology.local_of(rank) for t in targets)
        # The nearest next nodes of the ring, in order.
        node = topology.node_of(rank)
        assert nodes == [(node + j) % topology.nodes for j in range(1, scheme.copies)]
        assert scheme.holders(rank, topology) == [node, *nodes]
        received.update(targets)
    # Every rank receives exactly as many copies as it sends: no node is a hot spot.
    assert received == Counter({rank: scheme.copies - 1 for rank in range(topology.world)})


# -- Parity groups and stripes ---------------------------------------------------------------


@st.composite
def parity_layouts(draw: st.DrawFn) -> tuple[Parity, Topology]:
    k = draw(st.integers(1, 5))
    m = draw(st.integers(1, 3))
    nodes = draw(st.integers(k + m, 4 * (k + m) + 3))
    local = draw(st.integers(1, 3))
    return Parity(k, m), Topology(nodes * local, local)


@settings(max_examples=150, deadline=None)
@given(parity_layouts())
def test_parity_groups_cover_every_node_once_with_the_leftovers_spread(
    layout: tuple[Parity, Topology],
) -> None:
    scheme, topology = layout
    scheme.check(topology)
    groups = scheme.groups(topology)
    size = scheme.k + scheme.m
    assert len(groups) == topology.nodes // size
    every = [node for group in groups for node in group]
    assert sorted(every) == list(range(topology.nodes))  # each node in exactly one group
    assert all(group == sorted(group) for group in groups)
    sizes = [len(group) for group in groups]
    assert min(sizes) >= size  # never a group too small to rebuild m lost nodes
    assert max(sizes) - min(sizes) <= 1  # the nodes left over spread, one per group
    for node in range(topology.nodes):
        assert node in scheme.group_of(node, topology)


@settings(max_examples=150, deadline=None)
@given(parity_layouts())
def test_each_node_holds_data_in_s_minus_m_stripes_and_parity_in_m(layout: tuple[Parity, Topology]) -> None:
    scheme, topology = layout
    for group in scheme.groups(topology):
        s = len(group)
        stripes = scheme.stripes(group[0], topology)
        assert [t.index for t in stripes] == list(range(s))
        for node in group:  # every node of the group computes the same stripes
            assert scheme.stripes(node, topology) == stripes
        for stripe in stripes:
            assert len(stripe.parity) == scheme.m and len(set(stripe.parity)) == scheme.m
            assert len(stripe.data) == s - scheme.m
            assert sorted(stripe.data + stripe.parity) == group  # data and parity: the group
        for node in group:
            data_in = [t for t in stripes if node in t.data]
            parity_in = [t for t in stripes if node in t.parity]
            assert len(data_in) == s - scheme.m
            assert len(parity_in) == scheme.m
            # Its chunks, one per data stripe, numbered in stripe order.
            assert [t.chunk_of(node, stripes) for t in data_in] == list(range(s - scheme.m))


def test_stripes_of_one_group_of_three_by_hand() -> None:
    # Parity(2, 1) over 3 nodes: stripe t keeps its parity on node t.
    stripes = Parity(2, 1).stripes(0, Topology(3, 1))
    assert [(t.data, t.parity) for t in stripes] == [((1, 2), (0,)), ((0, 2), (1,)), ((0, 1), (2,))]
    assert [stripes[1].chunk_of(0, stripes), stripes[2].chunk_of(0, stripes)] == [0, 1]
    assert [stripes[0].chunk_of(2, stripes), stripes[1].chunk_of(2, stripes)] == [0, 1]


def test_leftover_nodes_join_the_first_groups() -> None:
    # 11 nodes in groups of 3: three groups, the two left over go to groups 0 and 1.
    assert Parity(2, 1).groups(Topology(11, 1)) == [[0, 1, 2, 9], [3, 4, 5, 10], [6, 7, 8]]
    # Fewer groups than leftovers: one group takes all of them.
    assert Parity(2, 2).groups(Topology(7, 1)) == [list(range(7))]


# -- Topology --------------------------------------------------------------------------------


def test_topology_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    topology = Topology.of(12)
    assert topology == Topology(12, 4) and topology.nodes == 3
    assert [topology.node_of(r) for r in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert [topology.local_of(r) for r in (0, 3, 4, 11)] == [0, 3, 0, 3]
    assert topology.ranks_of(1) == [4, 5, 6, 7]
    for rank in range(12):
        assert topology.rank_at(topology.node_of(rank), topology.local_of(rank)) == rank


def test_topology_without_local_world_size_is_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Topology.of(6) == Topology(6, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert Topology.of(6).nodes == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [("3", "LOCAL_WORLD_SIZE=3 does not divide the world size 8"), ("0", "LOCAL_WORLD_SIZE=0"),
     ("-2", "LOCAL_WORLD_SIZE=-2"), ("16", "LOCAL_WORLD_SIZE=16"), ("two", "must be an int")],
)  # fmt: skip
def test_a_local_world_size_that_does_not_divide_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, raw: str, message: str
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", raw)
    with pytest.raises(ConfigError, match=message):
        Topology.of(8)


def test_topology_from_a_node_id_function_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert Topology.of(8, lambda rank: rank // 2) == Topology(8, 2)
    assert Topology.of(8, lambda rank: 0) == Topology(8, 8)
    assert Topology.of(5, lambda rank: rank) == Topology(5, 1)


@pytest.mark.parametrize(
    "node_of",
    [
        lambda rank: rank // 2 + 1,  # nodes not numbered from 0
        lambda rank: 0 if rank < 3 else 1,  # 3 and 5 ranks: not the same count per node
        lambda rank: [0, 0, 2, 2, 4, 4, 3, 3][rank],  # a node number skipped
    ],
)
def test_a_bad_node_id_function_is_a_config_error(node_of: object) -> None:
    with pytest.raises(ConfigError, match="node-id function must number nodes 0, 1"):
        Topology.of(8, node_of)  # type: ignore[arg-type]


def test_a_node_id_function_may_place_ranks_in_any_order_to_spread_copies_over_racks() -> None:
    # Two racks of two nodes each: nodes 0, 2 in rack A, 1, 3 in rack B, ranks 0-3 in rack A:
    # the ring's neighbours (node n + 1) are then always in the other rack.
    topology = Topology.of(8, lambda rank: [0, 0, 2, 2, 1, 1, 3, 3][rank])
    assert topology.placement == (0, 0, 2, 2, 1, 1, 3, 3) and topology.nodes == 4
    assert [topology.node_of(r) for r in range(8)] == [0, 0, 2, 2, 1, 1, 3, 3]
    assert [topology.local_of(r) for r in range(8)] == [0, 1] * 4
    assert topology.ranks_of(1) == [4, 5] and topology.rank_at(2, 1) == 3
    rack = {0: "A", 2: "A", 1: "B", 3: "B"}
    for rank in range(8):
        (target,) = Replicas(2).targets(rank, topology)
        assert rack[topology.node_of(target)] != rack[topology.node_of(rank)]
        assert topology.local_of(target) == topology.local_of(rank)
    interleaved = Topology.of(4, lambda rank: rank % 2)  # ranks 0, 2 on node 0; 1, 3 on node 1
    assert interleaved.ranks_of(0) == [0, 2] and Replicas(2).targets(2, interleaved) == [3]
