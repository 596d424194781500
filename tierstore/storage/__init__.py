"""Storage: the backend contract every tier is built on, and the backends that ship with tierstore.

- :mod:`~tierstore.storage.backend`: the contract (:class:`~tierstore.storage.backend.Backend`).
- :mod:`~tierstore.storage.registry`: URL scheme -> backend, built-ins and entry-point plugins.
- :mod:`~tierstore.storage.local`, :mod:`~tierstore.storage.memory`,
  :mod:`~tierstore.storage.fsspec_backend`: the built-in backends.
- :mod:`~tierstore.storage.faults`: named crash points the test suite arms.
"""
