"""Tiers and migration: a store's tiers, what they hold, and copying checkpoints between them.

- :mod:`~tierstore.tiers.tier`: ``Tier`` (a backend in a role) and ``Store`` (a store's tiers).
- :mod:`~tierstore.tiers.catalog`: the committed checkpoints a store holds.
- :mod:`~tierstore.tiers.migrator`: the background worker that copies hot to cold.
- :mod:`~tierstore.tiers.workers`: this process's migrators; forgotten after fork, drained at exit.
- :mod:`~tierstore.tiers.marks`: the marks migration leaves in the tiers.
- :mod:`~tierstore.tiers.status`: what is migrated, pending or failed; finishing pending work.
- :mod:`~tierstore.tiers.transfer`: verified copies of files between tiers.
- :mod:`~tierstore.tiers.restore`: cold back to hot.
"""
