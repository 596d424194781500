"""Losing a node costs no checkpoint (issue 37): real jobs of gloo processes as nodes of two
ranks each (FSDP2 + AdamW on CPU), each node its own hot directory, the cold tier an S3 URL
on a closed port. The job is SIGKILLed once its copies are verified; a node's directory is
deleted; the relaunch, with that node on an empty directory and the same constructor
arguments, resumes bit-exact from the surviving nodes and reads nothing from the cold tier.

One save per scheme (module fixtures), copied for each node lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from copies_launch import check_resumed, copy_tree, lose_node, resume, save_and_kill

REPLICAS = ["replicas", 2]
PARITY = ["parity", 2, 1]


def _saved(tmp_path_factory: pytest.TempPathFactory, world: int, scheme: list[Any]) -> tuple[Path, dict]:
    where = tmp_path_factory.mktemp("saved")
    saved = save_and_kill(where, world, scheme, saves=[1, 2, 3])
    return where / "nodes", saved


@pytest.fixture(scope="module")
def replicas_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return _saved(tmp_path_factory, 4, REPLICAS)  # 2 nodes x 2 ranks


@pytest.fixture(scope="module")
def parity_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return _saved(tmp_path_factory, 6, PARITY)  # 3 nodes x 2 ranks


@pytest.mark.parametrize("lost", [1, 0], ids=["a-node-lost", "the-coordinators-node-lost"])
def test_replicas_a_lost_node_resumes_bit_exact_from_its_peers_with_the_cold_tier_down(
    tmp_path: Path, replicas_saved: tuple[Path, dict], lost: int
) -> None:
    nodes = copy_tree(replicas_saved[0], tmp_path / "nodes")
    lose_node(nodes, lost)
    resumed = resume(nodes, tmp_path / "out", 4, REPLICAS)
    check_resumed(replicas_saved[1], resumed, lost)
    # The replaced node holds its files again: losing the other node now would cost nothing.
    assert any((nodes / f"node{lost}" / "checkpoints").rglob("*.distcp")), "its own shards are back"
    assert any((nodes / f"node{lost}" / "replicas" / "checkpoints").rglob("*.distcp")), "and its copies"


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_parity_over_three_nodes_rebuilds_any_lost_node_bit_exact(
    tmp_path: Path, parity_saved: tuple[Path, dict], lost: int
) -> None:
    # Parity(2, 1) over 3 nodes: each node keeps parity blocks of half its data's size, and
    # any one node is rebuilt byte-exact from the other two.
    nodes = copy_tree(parity_saved[0], tmp_path / "nodes")
    lose_node(nodes, lost)
    resumed = resume(nodes, tmp_path / "out", 6, PARITY)
    check_resumed(parity_saved[1], resumed, lost)
    assert any((nodes / f"node{lost}" / "checkpoints").rglob("*.distcp")), "its own shards are rebuilt"
    assert any((nodes / f"node{lost}" / "replicas" / "checkpoints").rglob("parity/*.bin")), "and its parity"


def test_parity_costs_one_and_a_half_times_the_disk(parity_saved: tuple[Path, dict]) -> None:
    # (1 + m/(s-m)) with s = 3 nodes per group, m = 1: parity blocks are half the data, a
    # little more for the padding of uneven chunks; Replicas(2) would cost twice.
    nodes = parity_saved[0]
    data = sum(f.stat().st_size for f in nodes.glob("node*/checkpoints/**/*.distcp"))
    parity = sum(f.stat().st_size for f in nodes.glob("node*/replicas/checkpoints/**/parity/*.bin"))
    assert data > 0
    assert 0.5 <= parity / data < 0.6, (parity, data)
