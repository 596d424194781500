"""Lifecycle: what is kept, deleted, protected and re-checked after a checkpoint is committed.

- :mod:`~tierstore.lifecycle.retention`: policies (``keep_last`` and friends).
- :mod:`~tierstore.lifecycle.prune`: applying them, never deleting the only valid copy.
- :mod:`~tierstore.lifecycle.gc`: removing what no manifest references.
- :mod:`~tierstore.tiers.leases`: loads announce themselves so prune waits for them.
- :mod:`~tierstore.lifecycle.scrub`: re-reading every byte of a store (``tierstore verify``).
"""
