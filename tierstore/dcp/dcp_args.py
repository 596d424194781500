"""What DCP's own ``FileSystemWriter``/``FileSystemReader`` arguments mean for tierstore.

A script written for DCP's file system storage should switch to
:class:`~tierstore.TieredWriter`/:class:`~tierstore.TieredReader` by changing the class
only. So their arguments are accepted here with the meaning they have in DCP, or refused
with a message saying what to do instead, never with a bare ``TypeError``:

- ``path``: the hot tier (DCP's name for the first argument, ``hot`` in tierstore).
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
  ``extensions``): a script that swaps ``FileSystemWriter`` for ``TieredWriter`` keeps them.
  The same option given in ``options=`` too is a ``ConfigError``.
- ``serialization_format``: ``TORCH_SAVE`` accepted; ``SAFETENSORS`` refused.

tierstore 0.1.0 is the first release, so the keywords tierstore's own constructors took
before it (tier options, ``node_local=``, the options the option objects replaced) are no
shims: each is a ``TypeError`` naming what to write instead (:func:`refuse`).

A ``checkpoint_id`` is a checkpoint name, or a directory directly under a tier's root
(``<root>/<name>``, as a FileSystemWriter user names a checkpoint by its directory).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypedDict

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import SerializationFormat

from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.options import WriterOptions
from tierstore.storage.registry import split_scheme
from tierstore.tiers.tier import Store, TierURL

__all__ = [
    "FileSystemWriterArgs",
    "FileSystemReaderArgs",
    "writer_options",
    "reader_args",
    "check_dcp_args",
    "first_tier",
    "refuse",
    "checkpoint_name",
]


class FileSystemWriterArgs(TypedDict, total=False):
    """The keywords :class:`~tierstore.TieredWriter` takes besides its own: ``FileSystemWriter``'s."""

    path: TierURL
    thread_count: int
    single_file_per_rank: bool
    sync_files: bool
    per_thread_copy_ahead: int
    cache_staged_state_dict: bool
    overwrite: bool
    _extensions: Sequence[StreamTransformExtension] | None
    serialization_format: SerializationFormat | str | None


class FileSystemReaderArgs(TypedDict, total=False):
    """The keyword :class:`~tierstore.TieredReader` takes besides its own: ``FileSystemReader``'s
    ``path`` (its ``_extension_registry`` is a parameter of the reader's own)."""

    path: TierURL


# FileSystemWriter's arguments that are WriterOptions fields (by the field's name).
_FOLDED = {
    "thread_count": "thread_count",
    "single_file_per_rank": "single_file_per_rank",
    "_extensions": "extensions",
}
_CHECKED = (
    "sync_files",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "overwrite",
    "serialization_format",
)
_STORE = "{owner}(Store.of(hot, cold, {arg}=...), ...): a Store holds its tiers' options"
# Keywords tierstore's constructors took before 0.1.0, the first release: what to write instead.
GONE = {
    "hot_options": _STORE,
    "cold_options": _STORE,
    "node_local": _STORE,
}
WRITER_GONE = {
    **GONE,
    "encoding": "{owner}(..., options=WriterOptions({arg}=...))",
    "manifest_part_ranks": "{owner}(..., options=WriterOptions({arg}=...))",
    "max_files_per_dir": "{owner}(..., options=WriterOptions({arg}=...))",
}
READER_GONE = {
    **GONE,
    "thread_count": "{owner}(..., options=ReaderOptions({arg}=...))",
    "lease": "{owner}(..., options=ReaderOptions({arg}=...))",
    "resolve_once": "{owner}(..., options=ReaderOptions({arg}=...))",
}


def refuse(owner: str, args: Collection[str], known: Collection[str], gone: Mapping[str, str]) -> None:
    """A ``TypeError`` for a keyword in ``args`` that ``owner`` does not take: one that
    ``gone`` names says what to write instead; any other is Python's own message."""
    for arg in sorted(args):
        if arg in gone:
            instead = gone[arg].format(owner=owner, arg=arg)
            raise TypeError(f"{owner}() no longer takes {arg}=: pass {instead}")
        if arg not in known:
            raise TypeError(f"{owner}() got an unexpected keyword argument {arg!r}")


def first_tier(hot: TierURL | Store | None, args: Mapping[str, Any], owner: str) -> TierURL | Store | None:
    """``hot``, or DCP's ``path=`` in ``args`` for it; both is an error."""
    path: TierURL | None = args.get("path")
    if path is None:
        return hot
    if hot is not None:
        raise ConfigError(
            f"{owner} got both hot and path=: path= is DCP's name for the hot tier, give one of them"
        )
    return path


def reader_args(args: Mapping[str, Any], owner: str = "TieredReader") -> None:
    """Refuse what ``FileSystemReader`` does not take (:func:`refuse`)."""
    refuse(owner, args, FileSystemReaderArgs.__annotations__, READER_GONE)


def writer_options(
    options: WriterOptions | None,
    args: Mapping[str, Any],
    owner: str = "TieredWriter",
    *,
    param: str = "options",
) -> tuple[WriterOptions, bool]:
    """``options`` with ``FileSystemWriter``'s arguments in ``args`` folded in, each checked
    (module docstring); and DCP's ``overwrite``.

    An argument that is none of them is a ``TypeError`` (:func:`refuse`); one also set in
    ``options`` is a ``ConfigError``.
    """
    refuse(owner, args, ("path", *_FOLDED, *_CHECKED), WRITER_GONE)
    check_dcp_args(
        sync_files=args.get("sync_files", True),
        per_thread_copy_ahead=args.get("per_thread_copy_ahead", 10_000_000),
        cache_staged_state_dict=args.get("cache_staged_state_dict", False),
        serialization_format=args.get("serialization_format"),
    )
    given = {
        _FOLDED[name]: (name, args[name])
        for name in _FOLDED
        # _extensions=None is FileSystemWriter's default: nothing given
        if name in args and not (name == "_extensions" and args[name] is None)
    }
    return _fold(owner, param, options, given), bool(args.get("overwrite", False))


def _fold(
    owner: str, param: str, options: WriterOptions | None, given: Mapping[str, tuple[str, Any]]
) -> WriterOptions:
    """``options`` (``WriterOptions()`` if ``None``) with the arguments in ``given`` (field ->
    the argument's name, its value) folded in, checked as ``WriterOptions`` checks its fields.
    A field given both ways is a ``ConfigError``; "given" in ``options`` means other than its
    default, the only thing a frozen dataclass tells."""
    if options is not None and not isinstance(options, WriterOptions):
        raise ConfigError(f"{owner}({param}=) takes a WriterOptions, got {type(options).__name__}")
    defaults = WriterOptions()
    for name, (argument, value) in given.items():
        if options is not None and getattr(options, name) != getattr(defaults, name):
            raise ConfigError(
                f"{owner} got {argument}={value!r} and {param}=WriterOptions({name}="
                f"{getattr(options, name)!r}): give {name} once, in {param}"
            )
    base = options if options is not None else defaults
    return dataclasses.replace(base, **{name: value for name, (_, value) in given.items()})


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
