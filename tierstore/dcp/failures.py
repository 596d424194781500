"""DCP's failures, unwrapped in one place.

DCP gathers every rank's error of a save or load into one ``CheckpointException`` (a
``BaseException``, not an ``Exception``), whose ``failures`` maps each failing rank to the
error, or to ``(error, traceback)``. Whoever needs the errors themselves (is this damage? which
rank? what to tell the user?) asks here.
"""

from __future__ import annotations

from typing import Any

from tierstore.errors import SaveFailed, TierstoreError

__all__ = ["rank_errors", "causes", "describe", "save_failed"]


def _unwrap(found: Any) -> BaseException:
    error = found[0] if isinstance(found, tuple) else found  # DCP wraps (error, traceback)
    return error if isinstance(error, BaseException) else RuntimeError(repr(error))


def rank_errors(err: BaseException) -> dict[int | None, BaseException]:
    """Each failing rank's own error; ``{None: err}`` for an error that is not DCP's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        return {rank: _unwrap(found) for rank, found in failures.items()}
    return {None: err}


def causes(err: BaseException) -> list[BaseException]:
    """The errors inside ``err`` (every rank's, for DCP's), ``[err]`` for any other."""
    return list(rank_errors(err).values())


def describe(err: BaseException) -> str:
    """One line naming each rank's error (``rank 1: ChecksumMismatch: ...``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {describe(_unwrap(found))}" for rank, found in sorted(failures.items())
        )
    if isinstance(err, SaveFailed):
        return str(err)
    return f"{type(err).__name__}: {err}"


def save_failed(step: int, err: BaseException) -> SaveFailed:
    """The :class:`SaveFailed` for a failed save of ``step``, naming every rank's error and
    carrying ``step``, ``errors`` and the first error's checkpoint, tier and file, all as
    context, so they survive pickling (DCP's PROCESS mode and worker processes)."""
    errors = rank_errors(err)
    first = next(iter(errors.values()), None)
    named = (
        {"checkpoint": first.checkpoint, "tier": first.tier, "file": first.file}
        if isinstance(first, TierstoreError)
        else {}
    )
    failure = SaveFailed(
        f"checkpoint of step {step} failed: {describe(err)}", step=step, errors=errors, **named
    )
    failure.__cause__ = err
    return failure
