"""What DCP's own ``FileSystemWriter``/``FileSystemReader`` arguments mean for tierstore.

A script written for DCP's file system storage should switch to
:class:`~tierstore.TieredWriter`/:class:`~tierstore.TieredReader` by changing the class
only. So their arguments are accepted here with the meaning they have in DCP, or refused
with a message saying what to do instead, never with a bare ``TypeError``:

- ``path``: the hot tier (DCP's name for the first argument).
- ``sync_files=True``: what tierstore always does (every file is durable before the commit,
  docs/design.md invariant 2). ``False`` is refused: it would break that invariant.
- ``per_thread_copy_ahead``: a GPU-to-host overlap knob; accepted, it changes no byte written.
- ``cache_staged_state_dict=True`` is refused: ``TieredWriter`` is no stager; reused staging
  buffers are :class:`~tierstore.CheckpointManager`'s (``StagingOptions(buffers="reuse")``) or
  :class:`tierstore.staging.ReusedStaging` given to ``dcp.async_save``.
- ``overwrite``: accepted; a committed checkpoint is refused either way (invariant 3) with
  DCP's wording, "Checkpoint already exists".
- ``_extensions`` (e.g. DCP's ``ZStandard``): applied to each stored item as DCP applies them,
  CRC32C taken of the transformed bytes; they need ``encoding="dcp"`` (chosen for you
  when ``encoding`` is not given), because the raw encoding reads ranges of items in place.
- ``thread_count``, ``single_file_per_rank``, ``_extensions``: folded into the writer's
  :class:`~tierstore.WriterOptions` (``thread_count``, ``single_file_per_rank``,
  ``extensions``), without a warning: a script that swaps ``FileSystemWriter`` for
  ``TieredWriter`` keeps them. The same option given in ``options=`` too is an error.
- ``serialization_format``: ``TORCH_SAVE`` accepted; ``SAFETENSORS`` refused.

A ``checkpoint_id`` is a checkpoint name, or a directory directly under a tier's root
(``<root>/<name>``, as a FileSystemWriter user names a checkpoint by its directory).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import SerializationFormat

from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.options import Encoding, ReaderOptions, WriterOptions, deprecated, fold
from tierstore.storage.registry import split_scheme
from tierstore.tiers.tier import Store, TierURL

__all__ = [
    "LegacyReaderArgs",
    "reader_options",
    "FileSystemWriterArgs",
    "writer_options",
    "check_dcp_args",
    "hot_or_path",
    "checkpoint_name",
]


def hot_or_path(hot: TierURL | Store | None, path: TierURL | None, owner: str) -> TierURL | Store | None:
    """``hot``, or DCP's ``path=`` for it; both is an error."""
    if path is None:
        return hot
    if hot is not None:
        raise ConfigError(
            f"{owner} got both hot and path=: path= is DCP's name for the hot tier, give one of them"
        )
    return path


class FileSystemWriterArgs(TypedDict, total=False):
    """The keywords :class:`~tierstore.TieredWriter` takes besides its own (module docstring):
    ``FileSystemWriter``'s, then, for one release, the ones :class:`WriterOptions` replaced."""

    thread_count: int
    single_file_per_rank: bool
    sync_files: bool
    per_thread_copy_ahead: int
    cache_staged_state_dict: bool
    overwrite: bool
    _extensions: Sequence[StreamTransformExtension] | None
    serialization_format: SerializationFormat | str | None
    encoding: Encoding | None  # deprecated: WriterOptions(encoding=)
    manifest_part_ranks: int | None  # deprecated: WriterOptions(manifest_part_ranks=)
    max_files_per_dir: int | None  # deprecated: WriterOptions(max_files_per_dir=)


# FileSystemWriter's arguments that are WriterOptions fields (by the field's name), and the
# arguments of tierstore 0.x that WriterOptions replaced (warned about, for one release).
_FOLDED = {
    "thread_count": "thread_count",
    "single_file_per_rank": "single_file_per_rank",
    "_extensions": "extensions",
}
_DEPRECATED = ("encoding", "manifest_part_ranks", "max_files_per_dir")
_CHECKED = (
    "sync_files",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "overwrite",
    "serialization_format",
)


def writer_options(
    options: WriterOptions | None,
    args: Mapping[str, Any],
    owner: str = "TieredWriter",
    *,
    param: str = "options",
    warn: bool = True,
) -> tuple[WriterOptions, bool]:
    """``options`` with ``FileSystemWriter``'s arguments (and the deprecated ones, with a
    ``DeprecationWarning`` unless ``warn`` is false) in ``args`` folded in, each checked
    (module docstring); and DCP's ``overwrite``.

    An argument that is none of them is a ``TypeError``, as Python's own; one also set in
    ``options`` is a ``ConfigError`` (:func:`tierstore.options.fold`).
    """
    unknown = sorted(set(args) - set(_FOLDED) - set(_DEPRECATED) - set(_CHECKED))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    for name in _DEPRECATED:
        if warn and name in args:
            deprecated(owner, name, f"{param}=WriterOptions({name}=...)", stacklevel=3)
    check_dcp_args(
        sync_files=args.get("sync_files", True),
        per_thread_copy_ahead=args.get("per_thread_copy_ahead", 10_000_000),
        cache_staged_state_dict=args.get("cache_staged_state_dict", False),
        serialization_format=args.get("serialization_format"),
    )
    given = {
        _FOLDED.get(name, name): (name, args[name])
        for name in (*_FOLDED, *_DEPRECATED)
        # _extensions=None is FileSystemWriter's default: nothing given
        if name in args and not (name == "_extensions" and args[name] is None)
    }
    folded = fold(owner, param, options, WriterOptions, given)
    return folded, bool(args.get("overwrite", False))


class LegacyReaderArgs(TypedDict, total=False):
    """The keywords :class:`~tierstore.TieredReader` took before :class:`ReaderOptions`,
    accepted for one release with a ``DeprecationWarning``."""

    thread_count: int
    lease: bool
    resolve_once: bool


_READER_LEGACY = ("thread_count", "lease", "resolve_once")


def reader_options(
    options: ReaderOptions | None, legacy: Mapping[str, Any], owner: str = "TieredReader"
) -> ReaderOptions:
    """``options`` with the old keywords in ``legacy`` folded in (each warned about once)."""
    unknown = sorted(set(legacy) - set(_READER_LEGACY))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    for name in legacy:
        deprecated(owner, name, f"options=ReaderOptions({name}=...)", stacklevel=3)
    given = {name: (name, value) for name, value in legacy.items()}
    return fold(owner, "options", options, ReaderOptions, given)


def check_dcp_args(
    *,
    sync_files: bool,
    per_thread_copy_ahead: int,
    cache_staged_state_dict: bool,
    serialization_format: SerializationFormat | str | None,
) -> None:
    """Refuse what tierstore cannot do of ``FileSystemWriter``'s arguments (module docstring)."""
    if not sync_files:
        raise ConfigError(
            "sync_files=False is not supported: tierstore makes every file durable "
            "before the commit (docs/design.md invariant 2); drop the argument "
            "(for scratch saves, put the hot tier on a memory disk such as /dev/shm)"
        )
    if (
        isinstance(per_thread_copy_ahead, bool)
        or not isinstance(per_thread_copy_ahead, int)
        or per_thread_copy_ahead < 0
    ):
        raise ConfigError(f"per_thread_copy_ahead must be a byte count >= 0, got {per_thread_copy_ahead!r}")
    if cache_staged_state_dict:
        raise ConfigError(
            "cache_staged_state_dict=True is not supported: TieredWriter does not "
            "stage; for staging buffers kept across async saves use "
            "CheckpointManager(staging=StagingOptions(buffers='reuse')), or pass "
            "async_stager=tierstore.staging.ReusedStaging(...) to dcp.async_save"
        )
    _check_format(serialization_format)


def _check_format(value: SerializationFormat | str | None) -> None:
    if value is None or value in (SerializationFormat.TORCH_SAVE, SerializationFormat.TORCH_SAVE.value):
        return
    if value in (SerializationFormat.SAFETENSORS, SerializationFormat.SAFETENSORS.value):
        raise ConfigError(
            "serialization_format=SAFETENSORS is not supported: tierstore stores "
            "items with encoding='raw' (tensor bytes as they are) or 'dcp' "
            "(torch.save, as SerializationFormat.TORCH_SAVE); drop the argument, "
            "or save safetensors with DCP's HuggingFaceStorageWriter"
        )
    raise ConfigError(f"unknown serialization_format {value!r}: DCP knows TORCH_SAVE and SAFETENSORS")


def checkpoint_name(checkpoint_id: str | os.PathLike[str], roots: Sequence[str]) -> str:
    """The checkpoint a DCP ``checkpoint_id`` names: a checkpoint name, or a directory
    directly under one of ``roots`` (tier URLs or paths) whose last part is the name."""
    text = os.fspath(checkpoint_id)
    if layout.is_name(text):
        return text
    where = _under(text, roots)
    if where is None:
        shown = ", ".join(roots) or "none"
        raise ConfigError(
            f"checkpoint_id {text!r} is not a checkpoint name nor a directory directly under a "
            f"tier root ({shown}); a checkpoint_id names a checkpoint inside the store: pass "
            "its name (e.g. 'step-100'), or '<root>/<name>'"
        )
    return layout.check_name(where)


def _under(text: str, roots: Sequence[str]) -> str | None:
    """The last part of ``text`` when its parent is one of ``roots``, else ``None``."""
    scheme, url = split_scheme(text)
    for root in roots:
        root_scheme, root_url = split_scheme(root)
        if root_scheme != scheme:
            continue
        if scheme == "file":
            parent, leaf = os.path.split(os.path.realpath(_local(url)))
            if parent == os.path.realpath(_local(root_url)):
                return leaf
        else:
            parent, leaf = posixpath.split(url.rstrip("/"))
            if parent == root_url.rstrip("/"):
                return leaf
    return None


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path
