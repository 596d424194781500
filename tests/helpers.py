"""Small helpers shared by the core tests."""

from __future__ import annotations


def unwrap(exc: BaseException) -> BaseException:
    """The first rank's original error inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc
