"""A committed checkpoint out of the store, for the rest of the ecosystem (``tierstore export``).

The full (unsharded) state is loaded with DCP itself, as its ``dcp_to_torch_save`` does
(``_EmptyStateDictLoadPlanner``, ``no_dist=True``), through :class:`TieredReader`: from any
tier holding the checkpoint, every byte verified as in every load. It is written as

* ``safetensors``: Hugging Face's layout, ``model.safetensors`` or shards
  ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` bytes each (one larger
  tensor is a shard of its own), plus ``model.safetensors.index.json``; tensors only, by
  their flat DCP key less ``strip_prefix``. Without ``strip_prefix`` the model's weights
  only, its prefix found from the keys (``train.model.`` for ``CheckpointManager`` with a
  ``TrainingState``), the second name of a tied weight left out (both: ``_model_keys``), so
  that with ``config`` (a ``config.json`` copied in) ``from_pretrained(out)`` loads it as it
  is; ``all_keys`` writes every tensor. ``dtype`` casts floating tensors. Each shard is
  loaded on its own, so memory holds one shard, not the whole state; written by the
  ``safetensors`` library (``pip install 'tierstore[export]'``);
* ``torch``: one ``torch.save`` file, ``state_dict.pt``: the state nested as it was saved
  (DCP's ``dcp_to_torch_save``), or with ``strip_prefix`` a flat ``{key: value}`` dict of
  the keys under it (a ``pytorch_model.bin``); ``dtype`` casts its floating tensors;
* ``dcp``: a plain DCP checkpoint (``FileSystemWriter``'s layout) that
  ``dcp.FileSystemReader(out)`` reads.

Everything is written into a fresh directory next to ``out`` and renamed into place last, so
``out`` never shows half an export; a failed export leaves ``out`` as it was. An existing
non-empty ``out`` is refused unless ``force``, which replaces it whole. The directory and its
files get the modes the umask gives (0777 and 0666 less it), ready to share.

``out`` is never a tier's directory, one inside a tier or one above a tier (docs/design.md,
"commands never delete a tier root"): refused, ``force`` or not, before anything is read.
``force`` never replaces the current or home directory (or one above either), nor a tree
holding any tierstore tier, this store's or another's. Both are checked again right before
``out`` is replaced (fault point ``export.before_replace`` between the two).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tierstore.dcp._export_files import (
    CONFIG_FILE,
    SAFETENSORS_INDEX,
    TORCH_FILE,
    Writing,
    flat,
    read_config,
    shards,
    strip,
    write_dcp,
    write_safetensors,
    write_torch,
)
from tierstore.dcp._model_keys import digest, model_prefix, tie_candidates, ties
from tierstore.dcp.failures import rank_errors
from tierstore.dcp.reader import TieredReader
from tierstore.errors import ConfigError, TierstoreError
from tierstore.format.manifest import Manifest
from tierstore.options import ReaderOptions
from tierstore.progress import ProgressCallback, counting
from tierstore.storage import faults
from tierstore.tiers.roots import refuse_overlap, relation, tier_below
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = [
    "export",
    "ExportReport",
    "FORMATS",
    "DTYPES",
    "DEFAULT_SHARD_SIZE",
    "INSTALL_EXPORT",
    "SAFETENSORS_INDEX",
    "TORCH_FILE",
    "CONFIG_FILE",
    "read_config",
]

FORMATS = ("safetensors", "torch", "dcp")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DEFAULT_SHARD_SIZE = 5 * 10**9  # Hugging Face's default "5GB"
INSTALL_EXPORT = "pip install 'tierstore[export]'"


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote: the checkpoint, where, and what it left out.

    ``files`` are the names written in ``out``; ``keys`` the entries written, ``bytes`` their
    tensors' bytes (as written: after ``dtype``); ``skipped`` the entries under the prefix
    that are not tensors (safetensors holds tensors only); ``prefix`` the prefix stripped,
    given or found (``None``: every key kept); ``outside_prefix`` the keys not under it, left
    out; ``tied`` each tied weight's second name left out, with the name it is tied to (both
    as written); ``dtype`` the cast, if any.
    """

    name: str
    step: int | None
    attempt: str
    format: str
    out: str
    files: tuple[str, ...]
    keys: int
    bytes: int
    skipped: tuple[str, ...]
    outside_prefix: tuple[str, ...]
    prefix: str | None
    tied: tuple[tuple[str, str], ...]
    dtype: str | None


def export(
    store: Store | TierURL,
    *,
    out: str | os.PathLike[str],
    name: str | None = None,
    step: int | None = None,
    format: str = "safetensors",
    strip_prefix: str | None = None,
    all_keys: bool = False,
    dtype: str | None = None,
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    thread_count: int = 1,
    progress: ProgressCallback | None = None,
) -> ExportReport:
    """Export a committed checkpoint (``name``, else the newest of ``step``, else the newest)
    of ``store`` into the local directory ``out`` as ``format`` (module docstring).

    ``strip_prefix``: only the keys under it, with it taken off (safetensors without it: the
    model's prefix, found; ``all_keys``: every tensor). ``dtype``: a name of :data:`DTYPES`,
    the floating tensors cast to it. ``config``: a ``config.json`` file copied into ``out``
    (safetensors).

    Raises :class:`~tierstore.ConfigError` for bad arguments (a URL or a non-empty directory
    as ``out`` without ``force``, an ``out`` that is a tier's directory, inside or above one,
    one ``force`` must not replace, an unknown format or dtype, a prefix no key is under,
    more than one model to choose from, a config that is not a JSON object, safetensors not
    installed), and what any load raises for a checkpoint that is not there or damaged in
    every tier (naming checkpoint, file and tier); ``out`` is then left as it was.
    """
    _check(format, max_shard_size, strip_prefix, all_keys, dtype, config)
    cast = DTYPES[dtype] if dtype is not None else None
    config_bytes = read_config(config) if config is not None else None
    store = Store.of(store)
    target = _target(out, force, store.tiers)
    save_file = _safetensors_writer() if format == "safetensors" else None
    options = ReaderOptions(thread_count=thread_count)
    metadata, manifest = _open(TieredReader(store, name=name, step=step, options=options))
    pick = _select(metadata, format, strip_prefix, all_keys, manifest.name)

    def load(keys: Collection[str], advance: Callable[[int], None]) -> dict[str, Any]:
        reader = TieredReader(store, name=manifest.name, options=options)
        return _load(reader, manifest, keys, advance)

    tied = _tied(metadata, pick, manifest.name, max_shard_size, load, progress) if save_file else {}
    wanted = [key for key in pick.wanted if key not in tied]
    sizes = {key: _nbytes(metadata, key, cast) for key in wanted}
    advance = counting(f"export {manifest.name}", sum(_nbytes(metadata, key) for key in wanted), progress)
    work = _workdir(target)
    writing = Writing(work, pick.prefix, cast, lambda keys: load(keys, advance))
    try:
        if save_file is not None:
            files = write_safetensors(writing, wanted, sizes, max_shard_size, save_file)
        elif format == "torch":
            files = write_torch(writing, wanted)
        else:
            files = write_dcp(work, writing.load(wanted))
        if config_bytes is not None:
            with open(os.path.join(work, CONFIG_FILE), "wb") as f:
                f.write(config_bytes)
            files.append(CONFIG_FILE)
        faults.point("export.before_replace")
        _target(out, force, store.tiers)  # what is there now, not what was there before the load
        _into_place(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return ExportReport(
        name=manifest.name,
        step=manifest.step,
        attempt=manifest.attempt,
        format=format,
        out=target,
        files=tuple(files),
        keys=len(wanted),
        bytes=sum(sizes.values()),
        skipped=pick.skipped,
        outside_prefix=pick.outside,
        prefix=pick.prefix,
        tied=tuple((strip(key, pick.prefix), strip(first, pick.prefix)) for key, first in tied.items()),
        dtype=dtype,
    )


def _check(
    format: str,
    max_shard_size: int,
    strip_prefix: str | None,
    all_keys: bool,
    dtype: str | None,
    config: str | os.PathLike[str] | None,
) -> None:
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, not {max_shard_size!r}")
    if strip_prefix is not None and not strip_prefix:
        raise ConfigError("strip_prefix must be a non-empty key prefix, e.g. 'train.model.'")
    if strip_prefix is not None and format == "dcp":
        raise ConfigError("strip_prefix is for format safetensors or torch: a dcp export keeps every key")
    if all_keys and (strip_prefix is not None or format != "safetensors"):
        raise ConfigError(
            "all_keys is for format safetensors without strip_prefix: torch keeps every key unless "
            "given strip_prefix, dcp every key"
        )
    if dtype is not None and (dtype not in DTYPES or format == "dcp"):
        raise ConfigError(
            f"dtype {dtype!r}: give one of {', '.join(DTYPES)}, for format safetensors or torch "
            "(a dcp export keeps the checkpoint as it is)"
        )
    if config is not None and format != "safetensors":
        raise ConfigError("config is for format safetensors: the directory from_pretrained loads")


@dataclass(frozen=True)
class _Selection:
    """What an export writes (``wanted``), the prefix it strips and what it leaves out."""

    wanted: list[str]
    prefix: str | None
    outside: tuple[str, ...]
    skipped: tuple[str, ...]


def _select(
    metadata: Metadata, format: str, strip_prefix: str | None, all_keys: bool, name: str
) -> _Selection:
    tensors, others = _entries(metadata)
    prefix = strip_prefix
    if format == "safetensors" and prefix is None and not all_keys:
        prefix = model_prefix(tensors)
    wanted, outside = _under(tensors if format == "safetensors" else [*tensors, *others], prefix)
    if not wanted:
        raise ConfigError(
            f"no {'tensor' if format == 'safetensors' else 'key'} of the checkpoint is under "
            f"the prefix {prefix!r}; its keys begin {sorted(tensors)[:3]}",
            checkpoint=name,
        )
    skipped: list[str] = []
    if format == "safetensors":  # entries under the prefix that are not tensors; the rest are outside it
        skipped, beside = _under(others, prefix)
        outside += beside
    return _Selection(wanted, prefix, tuple(sorted(outside)), tuple(sorted(skipped)))


def _tied(
    metadata: Metadata,
    pick: _Selection,
    name: str,
    cap: int,
    load: Callable[[Collection[str], Callable[[int], None]], dict[str, Any]],
    progress: ProgressCallback | None,
) -> dict[str, str]:
    """``{second name: first}`` of the model's tied weights (``_model_keys``), their
    candidates read a batch of at most ``cap`` bytes at a time and compared by digest."""
    if pick.prefix is None:
        return {}
    candidates = tie_candidates(metadata, pick.wanted, pick.prefix)
    keys = candidates.keys
    if not keys:
        return {}
    sizes = {key: _nbytes(metadata, key) for key in keys}
    advance = counting(f"export {name}: tied weights", sum(sizes.values()), progress)
    digests: dict[str, str] = {}
    for batch in shards(keys, sizes, cap):
        loaded = flat(load(batch, advance))
        digests.update({key: digest(loaded[key]) for key in batch})
        del loaded
    return ties(candidates, digests)


def _target(out: str | os.PathLike[str], force: bool, tiers: list[Tier]) -> str:
    text = os.fspath(out)
    if "://" in text:
        raise ConfigError(
            f"export writes into a local directory, not {text!r}: export there, then copy "
            "the directory (aws s3 cp --recursive, gcloud storage cp -r, huggingface-cli upload)"
        )
    target = os.path.abspath(os.path.expanduser(text))
    refuse_overlap(target, tiers, what="the export's out")
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise ConfigError(f"the export's out {target!r} exists and is not a directory")
        if os.listdir(target):
            if not force:
                raise ConfigError(
                    f"the export's out {target!r} is not empty: give an empty or new directory, "
                    "or force (--force) to replace it and everything in it"
                )
            _refuse_replacing(target)
    return target


def _refuse_replacing(target: str) -> None:
    """What ``force`` never replaces, whichever store is exported: the directory the command
    runs in, the home directory, one above either, or a tree holding a tier of any store."""
    for place, said in (
        (os.getcwd(), "the current directory"),
        (os.path.expanduser("~"), "the home directory"),
    ):
        if relation(target, place) in ("is", "above"):
            raise ConfigError(
                f"the export's out {target!r} is {said} or above it: force replaces a directory "
                "and everything in it; give the export a directory of its own"
            )
    found = tier_below(target)
    if found is not None:
        raise ConfigError(
            f"the export's out {target!r} holds a tierstore tier at {found!r} (a manifests/ "
            "directory and checkpoints/): force would delete it; give the export a directory "
            "of its own"
        )


def _safetensors_writer() -> Callable[..., None]:
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ConfigError(f"the safetensors export needs the safetensors package: {INSTALL_EXPORT}") from err
    return save_file


def _open(reader: TieredReader) -> tuple[Metadata, Manifest]:
    """The checkpoint's DCP metadata and manifest, read verified, its lease released."""
    try:
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, True)  # raises what resolving it found
    finally:
        reader.release()
    assert reader.manifest is not None
    return metadata, reader.manifest


def _entries(metadata: Metadata) -> tuple[list[str], list[str]]:
    """The checkpoint's flat keys: its tensors, and the rest (``BYTE_IO`` items)."""
    tensors: list[str] = []
    others: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        (tensors if isinstance(value, TensorStorageMetadata) else others).append(key)
    return tensors, others


def _under(keys: Iterable[str], prefix: str | None) -> tuple[list[str], list[str]]:
    keys = list(keys)
    if prefix is None:
        return keys, []
    return [k for k in keys if k.startswith(prefix)], [k for k in keys if not k.startswith(prefix)]


def _nbytes(metadata: Metadata, key: str, cast: torch.dtype | None = None) -> int:
    """The bytes of the tensor at ``key``, cast to ``cast`` if it is floating."""
    value = metadata.state_dict_metadata[key]
    if not isinstance(value, TensorStorageMetadata):
        return 0
    dtype = value.properties.dtype
    if cast is not None and dtype.is_floating_point:
        dtype = cast
    return value.size.numel() * torch.empty((), dtype=dtype).element_size()


class _Planner(_EmptyStateDictLoadPlanner):
    """DCP's planner for a load without a model, counting each tensor as it is committed."""

    def __init__(self, keys: Collection[str], advance: Callable[[int], None]) -> None:
        super().__init__(keys=set(keys))  # type: ignore[no-untyped-call]
        self._advance = advance

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._advance(tensor.numel() * tensor.element_size())


def _load(
    reader: TieredReader, manifest: Manifest, keys: Collection[str], advance: Callable[[int], None]
) -> dict[str, Any]:
    """``keys`` of the checkpoint, nested as saved; its own error out of DCP's wrapper."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=_Planner(keys, advance), no_dist=True)
    except BaseException as err:
        errors = list(rank_errors(err).values())
        if getattr(err, "failures", None) is not None and errors and isinstance(errors[0], TierstoreError):
            raise errors[0] from err
        raise
    finally:
        reader.release()
    if reader.manifest is None or reader.manifest.attempt != manifest.attempt:
        raise ConfigError(
            "the checkpoint was replaced by another attempt while it was exported (pruned and "
            "saved again?); export it again",
            checkpoint=manifest.name,
        )
    return state


def _workdir(target: str) -> str:
    """A fresh directory next to ``target`` to write the export in, made as ``mkdir`` makes
    one: 0777 less the umask (``tempfile.mkdtemp``'s 0700 became the export's mode: issue 38)."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    while True:
        work = os.path.join(parent, f".{os.path.basename(target)}.export-{secrets.token_hex(4)}")
        try:
            os.mkdir(work)
            return work
        except FileExistsError:
            continue


def _into_place(work: str, target: str) -> None:
    """``work`` renamed to ``target`` (a directory already there, empty or forced, replaced),
    each file given the mode the umask gives a new file: the safetensors library writes 0600."""
    mode = os.stat(work).st_mode & 0o666  # 0777 & ~umask (_workdir), less the execute bits
    for name in os.listdir(work):
        os.chmod(os.path.join(work, name), mode)
        _fsync(os.path.join(work, name))
    _fsync(work)
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.replaced-", dir=os.path.dirname(target))
        os.replace(target, os.path.join(old, "out"))
        os.replace(work, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, target)
    _fsync(os.path.dirname(target))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
