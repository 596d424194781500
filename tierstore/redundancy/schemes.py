"""What survives a lost node: :class:`Replicas` and :class:`Parity`, and where their copies go.

Nodes are numbered ``rank // LOCAL_WORLD_SIZE`` (torchrun's variable), or by a node-id
function given to :class:`Topology` (``ManagerOptions(node_of=)``: number nodes so that ring
neighbours and parity groups span racks); every node runs the same number of ranks. A rank's
copies always land on other nodes, each on the rank of the same local index there.

* ``Replicas(n)``: ``n`` copies in all (the rank's own and ``n - 1`` on the next nodes of a
  ring, ``node + 1 .. node + n - 1``: every node sends and receives as many bytes as any other,
  the load NVRx's cliques spread). Survives any ``n - 1`` lost nodes; costs ``n`` times the
  disk and ``n - 1`` times the checkpoint over the network.
* ``Parity(k, m)``: Reed-Solomon over groups of ``k + m`` consecutive nodes (nodes left over
  join the first groups, one each, as extra data members). In a group of ``s`` nodes there
  are ``s`` stripes; stripe ``t`` keeps its ``m`` parity blocks on the group's nodes
  ``t .. t + m - 1`` and takes one data chunk from each other node. Each node's data (its
  rank's files, in the manifest's order) is cut into ``s - m`` chunks, one per stripe it is a
  data member of. Any ``m`` lost nodes of a group are rebuilt byte-exact, at
  ``1 + m / (s - m)`` times the disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.errors import ConfigError

__all__ = ["Parity", "Replicas", "Scheme", "Stripe", "Topology"]


@dataclass(frozen=True)
class Replicas:
    """``copies`` verified copies of every rank's files, each on another node (2 or more)."""

    copies: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 2:
            raise ConfigError(f"Replicas(copies) needs an int of at least 2, got {self.copies!r}")

    @property
    def survives(self) -> int:
        """How many lost nodes (any of them) it survives."""
        return self.copies - 1

    def check(self, topology: Topology) -> None:
        if topology.nodes < self.copies:
            raise ConfigError(
                f"Replicas({self.copies}) needs at least {self.copies} nodes, the job has "
                f"{topology.nodes} ({topology.describe()}): a copy never lands on its own node"
            )

    def targets(self, rank: int, topology: Topology) -> list[int]:
        """The ranks that keep copies of ``rank``'s files, nearest first."""
        node, local = topology.node_of(rank), topology.local_of(rank)
        return [topology.rank_at((node + j) % topology.nodes, local) for j in range(1, self.copies)]

    def holders(self, rank: int, topology: Topology) -> list[int]:
        """The nodes holding ``rank``'s files once protected: its own first."""
        return [topology.node_of(rank)] + [topology.node_of(r) for r in self.targets(rank, topology)]

    def describe(self) -> str:
        return f"Replicas({self.copies})"


@dataclass(frozen=True)
class Parity:
    """Reed-Solomon parity: ``m`` parity blocks per ``k`` data chunks, over groups of ``k + m``
    nodes. ``m = 1`` is XOR; ``m > 1`` needs the ``erasure`` extra (``zfec``)."""

    k: int = 2
    m: int = 1

    def __post_init__(self) -> None:
        for what, value in (("k", self.k), ("m", self.m)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Parity({what}) needs a positive int, got {value!r}")
        if self.k + self.m > 256:
            raise ConfigError(f"Parity(k={self.k}, m={self.m}): k + m is at most 256")
        if self.m > 1:
            from tierstore.redundancy.codec import require_zfec

            require_zfec(self)

    @property
    def survives(self) -> int:
        return self.m

    def check(self, topology: Topology) -> None:
        if topology.nodes < self.k + self.m:
            raise ConfigError(
                f"Parity(k={self.k}, m={self.m}) needs at least {self.k + self.m} nodes, the job "
                f"has {topology.nodes} ({topology.describe()})"
            )

    def groups(self, topology: Topology) -> list[list[int]]:
        """The node groups, each of ``k + m`` nodes or a few more (the nodes left over)."""
        size = self.k + self.m
        count = topology.nodes // size
        groups = [list(range(g * size, (g + 1) * size)) for g in range(count)]
        for i, node in enumerate(range(count * size, topology.nodes)):
            groups[i % count].append(node)
        for group in groups:
            group.sort()
        return groups

    def group_of(self, node: int, topology: Topology) -> list[int]:
        return next(g for g in self.groups(topology) if node in g)

    def stripes(self, node: int, topology: Topology) -> list[Stripe]:
        """The stripes of ``node``'s group (the same list on every node of it)."""
        group = self.group_of(node, topology)
        size = len(group)
        stripes = []
        for t in range(size):
            parity = [group[(t + i) % size] for i in range(self.m)]
            data = [n for n in group if n not in parity]
            stripes.append(Stripe(t, tuple(data), tuple(parity)))
        return stripes

    def describe(self) -> str:
        return f"Parity(k={self.k}, m={self.m})"


Scheme = Replicas | Parity


@dataclass(frozen=True)
class Stripe:
    """Stripe ``index`` of a parity group: one chunk of each ``data`` node's data, and the
    parity blocks kept on the ``parity`` nodes (the i-th of them keeps block ``k + i``)."""

    index: int
    data: tuple[int, ...]
    parity: tuple[int, ...]

    def chunk_of(self, node: int, stripes: list[Stripe]) -> int:
        """Which of ``node``'s chunks this stripe takes: its count of earlier data stripes."""
        return sum(1 for s in stripes if s.index < self.index and node in s.data)


@dataclass(frozen=True)
class Topology:
    """The job's nodes: ``world`` ranks, ``local_world`` on each node. By default node
    ``rank // local_world`` (torchrun's numbering); ``placement`` (the node of each rank, from
    a node-id function) numbers them otherwise, e.g. so that neighbours on the ring, and the
    members of a parity group, are in different racks. A rank's local index is its place
    among its node's ranks, in rank order."""

    world: int
    local_world: int
    placement: tuple[int, ...] | None = None

    @classmethod
    def of(cls, world: int, node_of: Callable[[int], int] | None = None) -> Topology:
        """From ``LOCAL_WORLD_SIZE`` (torchrun), or ``node_of(rank)`` where given, which must
        number nodes 0, 1, ... and put the same number of ranks on each."""
        if node_of is not None:
            nodes = [node_of(r) for r in range(world)]
            count = len(set(nodes))
            local = world // count if count else 1
            if sorted(set(nodes)) != list(range(count)) or any(nodes.count(n) != local for n in set(nodes)):
                raise ConfigError(
                    "the node-id function must number nodes 0, 1, ... with the same count of "
                    f"ranks on each; it gave {nodes[:16]}"
                )
            consecutive = nodes == [r // local for r in range(world)]
            return cls(world, local, None if consecutive else tuple(nodes))
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        try:
            local = int(raw) if raw else world
        except ValueError:
            raise ConfigError(f"LOCAL_WORLD_SIZE must be an int, got {raw!r}") from None
        if local < 1 or world % local:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
        return cls(world, local)

    @property
    def nodes(self) -> int:
        return self.world // self.local_world

    def node_of(self, rank: int) -> int:
        return self.placement[rank] if self.placement is not None else rank // self.local_world

    def local_of(self, rank: int) -> int:
        if self.placement is None:
            return rank % self.local_world
        return self.ranks_of(self.placement[rank]).index(rank)

    def rank_at(self, node: int, local: int) -> int:
        if self.placement is None:
            return node * self.local_world + local
        return self.ranks_of(node)[local]

    def ranks_of(self, node: int) -> list[int]:
        if self.placement is None:
            return [node * self.local_world + local for local in range(self.local_world)]
        return [r for r, n in enumerate(self.placement) if n == node]

    def describe(self) -> str:
        placed = "" if self.placement is None else ", placed by a node-id function"
        return f"{self.world} ranks, {self.local_world} per node{placed}"
