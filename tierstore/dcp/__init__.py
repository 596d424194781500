"""DCP's side: ``TieredWriter`` and ``TieredReader``, the ``StorageWriter`` / ``StorageReader``
over a store's tiers, the raw-encoded reads, and FileSystemWriter/Reader argument parity.
"""
