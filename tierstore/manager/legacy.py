"""The keywords :class:`~tierstore.CheckpointManager` took before its options objects, kept
for one release: each folded into :class:`~tierstore.Retention`,
:class:`~tierstore.StagingOptions` or :class:`~tierstore.WriterOptions`, with a
``DeprecationWarning`` saying what to pass instead.
Delete this module, and ``**legacy`` in the constructor, in the next release."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from tierstore.dcp import dcp_args
from tierstore.errors import ConfigError
from tierstore.lifecycle.retention import Policy, Retention
from tierstore.options import StagingOptions, WriterOptions, deprecated, fold

__all__ = ["LegacyManagerArgs", "retention", "staging_options", "writer_options"]

OWNER = "CheckpointManager"

# The old keyword -> the StagingOptions field it became.
_STAGING = {"async_save": "async_save", "async_mode": "mode", "overlap_staging": "overlap"}
# The old keyword -> the Retention field it became.
_RETENTION = {"hot_policy": "hot", "cold_policy": "cold", "hot_min_free": "hot_min_free"}


class LegacyManagerArgs(TypedDict, total=False):
    hot_policy: Policy | None  # retention=Retention(hot=)
    cold_policy: Policy | None  # retention=Retention(cold=)
    hot_min_free: int | str | None  # retention=Retention(hot_min_free=)
    async_save: bool  # StagingOptions(async_save=)
    async_mode: str  # StagingOptions(mode=)
    overlap_staging: bool  # StagingOptions(overlap=)
    writer_options: Mapping[str, Any]  # writer=WriterOptions(...)


def check_names(legacy: Mapping[str, Any]) -> None:
    """An unknown keyword is a ``TypeError``, as Python's own would be."""
    unknown = sorted(set(legacy) - set(_STAGING) - set(_RETENTION) - {"writer_options"})
    if unknown:
        raise TypeError(f"{OWNER}() got an unexpected keyword argument {unknown[0]!r}")


def retention(retention: Retention | None, legacy: Mapping[str, Any]) -> Retention:
    """``retention`` with the old per-tier keywords folded in (a policy of ``None`` was the
    default, as it is in :class:`~tierstore.Retention`)."""
    given: dict[str, tuple[str, Any]] = {}
    for argument, field in _RETENTION.items():
        if argument in legacy:
            deprecated(OWNER, argument, f"retention=Retention({field}=...)", stacklevel=3)
            if legacy[argument] is not None or field == "hot_min_free":
                given[field] = (argument, legacy[argument])
    return fold(OWNER, "retention", retention, Retention, given)


def staging_options(staging: StagingOptions | str | None, legacy: Mapping[str, Any]) -> StagingOptions:
    """``staging`` with the old staging keywords folded in (``staging="reuse"``/``"fresh"``,
    the old form of the same argument, included)."""
    given: dict[str, tuple[str, Any]] = {}
    if isinstance(staging, str):
        deprecated(OWNER, "staging", "staging=StagingOptions(buffers=...)", stacklevel=3)
        given["buffers"] = ("staging", staging)
        staging = None
    for argument, field in _STAGING.items():
        if argument in legacy:
            deprecated(OWNER, argument, f"staging=StagingOptions({field}=...)", stacklevel=3)
            given[field] = (argument, legacy[argument])
    return fold(OWNER, "staging", staging, StagingOptions, given)


def writer_options(writer: WriterOptions | None, legacy: Mapping[str, Any]) -> tuple[WriterOptions, bool]:
    """``writer`` with the old ``writer_options`` mapping folded in (its keys are
    ``TieredWriter`` keywords); and DCP's ``overwrite``."""
    if "writer_options" not in legacy or legacy["writer_options"] is None:
        return dcp_args.writer_options(writer, {}, OWNER, param="writer")
    deprecated(OWNER, "writer_options", "writer=WriterOptions(...)", stacklevel=3)
    mapping = dict(legacy["writer_options"])
    try:
        return dcp_args.writer_options(writer, mapping, OWNER, param="writer", warn=False)
    except TypeError as err:  # an unknown key: say which options TieredWriter takes
        raise ConfigError(
            f"writer_options {sorted(mapping)} are not all TieredWriter arguments: {err}"
        ) from err
