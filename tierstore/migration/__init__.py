"""The migration engine: copying checkpoints between tiers, verified.

- :mod:`~tierstore.migration.migrator`: the background worker that copies hot to cold.
- :mod:`~tierstore.migration.jobs`: one job per rank and attempt, and its state.
- :mod:`~tierstore.migration.transfer`: verified copies of files between tiers.
- :mod:`~tierstore.migration.cold_commit`: publishing an attempt in the cold tier.
- :mod:`~tierstore.migration.delivery`: waiting for delivery within a deadline.
- :mod:`~tierstore.migration.probe`: is the cold tier answering (the breaker's probe).
- :mod:`~tierstore.migration.workers`: this process's migrators; forgotten after fork, drained at exit.
- :mod:`~tierstore.migration.status`: what is migrated, pending or failed; finishing pending work.
- :mod:`~tierstore.migration.restore`, :mod:`~tierstore.migration.copy`: cold back to hot, and a
  checkpoint copied out of the store.
"""
