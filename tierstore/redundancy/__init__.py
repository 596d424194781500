"""Copies of node-local checkpoints on other nodes: :class:`Replicas` and :class:`Parity`
(``CheckpointManager(Store(hot, cold, node_local=True),
options=ManagerOptions(redundancy=Replicas(2)))``).

:mod:`~tierstore.redundancy.schemes` says where copies go, :mod:`~tierstore.redundancy.wire`
moves bytes between ranks, :mod:`~tierstore.redundancy.records` keeps them on a node, and
:mod:`~tierstore.redundancy.protect` protects, restores and fetches (docs/operations.md,
"Copies on other nodes").
"""

from tierstore.redundancy.schemes import Parity, Replicas, Topology

__all__ = ["Parity", "Replicas", "Topology"]
