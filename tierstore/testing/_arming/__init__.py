"""Holds the ``sitecustomize`` hook of :mod:`tierstore.testing.faults` (a package, so wheels carry it)."""
