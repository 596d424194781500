"""Tiers: a store's tiers, what they hold, and the records kept in them.

- :mod:`~tierstore.tiers.tier`: ``Tier`` (a backend in a role) and ``Store`` (a store's tiers).
- :mod:`~tierstore.tiers.catalog`: the committed checkpoints a store holds.
- :mod:`~tierstore.tiers.marks`: the marks migration leaves in the tiers.
- :mod:`~tierstore.tiers.leases`, :mod:`~tierstore.tiers.runlock`: who may write or delete.
- :mod:`~tierstore.tiers.roots`, :mod:`~tierstore.tiers.usage`: a tier's root and its size.

Copying checkpoints between tiers (the migrator and its jobs, the cold commit, restore and
copy) is :mod:`tierstore.migration`, the layer above this one.
"""
