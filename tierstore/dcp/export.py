"""A committed checkpoint out of the store, for the rest of the ecosystem (``tierstore export``).

The full (unsharded) state is loaded with DCP itself, as its ``dcp_to_torch_save`` does
(``_EmptyStateDictLoadPlanner``, ``no_dist=True``), through :class:`TieredReader`: from any
tier holding the checkpoint, every byte verified as in every load. It is written as

* ``safetensors``: Hugging Face's layout, ``model.safetensors`` or shards
  ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` bytes each (one larger
  tensor is a shard of its own), plus ``model.safetensors.index.json``; tensors only, by
  their flat DCP key (``model.embed.weight``), less ``strip_prefix``; each shard is loaded on
  its own, so memory holds one shard, not the whole state; written by the ``safetensors``
  library (``pip install 'tierstore[export]'``);
* ``torch``: one ``torch.save`` file, ``state_dict.pt``: the state nested as it was saved
  (DCP's ``dcp_to_torch_save``), or with ``strip_prefix`` a flat ``{key: value}`` dict of
  the keys under it (a ``pytorch_model.bin``);
* ``dcp``: a plain DCP checkpoint (``FileSystemWriter``'s layout) that
  ``dcp.FileSystemReader(out)`` reads.

Everything is written into a fresh directory next to ``out`` and renamed into place last, so
``out`` never shows half an export; a failed export leaves ``out`` as it was. An existing
non-empty ``out`` is refused unless ``force``, which replaces it whole.

``out`` is never a tier's directory, one inside a tier or one above a tier (docs/design.md,
"commands never delete a tier root"): refused, ``force`` or not, before anything is read.
``force`` never replaces the current or home directory (or one above either), nor a tree
holding any tierstore tier, this store's or another's. Both are checked again right before
``out`` is replaced (fault point ``export.before_replace`` between the two).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from tierstore.dcp.failures import rank_errors
from tierstore.dcp.reader import TieredReader
from tierstore.errors import ConfigError, TierstoreError
from tierstore.format.manifest import Manifest
from tierstore.options import ReaderOptions
from tierstore.progress import ProgressCallback, counting
from tierstore.storage import faults
from tierstore.tiers.roots import refuse_overlap, relation, tier_below
from tierstore.tiers.tier import Store, Tier, TierURL

__all__ = ["export", "ExportReport", "FORMATS", "DEFAULT_SHARD_SIZE", "INSTALL_EXPORT"]

FORMATS = ("safetensors", "torch", "dcp")
DEFAULT_SHARD_SIZE = 5 * 10**9  # Hugging Face's default "5GB"
INSTALL_EXPORT = "pip install 'tierstore[export]'"
TORCH_FILE = "state_dict.pt"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote: the checkpoint, where, and what it left out.

    ``files`` are the names written in ``out``; ``keys`` the entries written, ``bytes`` their
    tensors' bytes; ``skipped`` the entries that are not tensors (safetensors holds tensors
    only); ``outside_prefix`` the keys not under ``strip_prefix``, left out.
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


def export(
    store: Store | TierURL,
    *,
    out: str | os.PathLike[str],
    name: str | None = None,
    step: int | None = None,
    format: str = "safetensors",
    strip_prefix: str | None = None,
    max_shard_size: int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    thread_count: int = 1,
    progress: ProgressCallback | None = None,
) -> ExportReport:
    """Export a committed checkpoint (``name``, else the newest of ``step``, else the newest)
    of ``store`` into the local directory ``out`` as ``format`` (module docstring).

    Raises :class:`~tierstore.ConfigError` for bad arguments (a URL or a non-empty directory
    as ``out`` without ``force``, an ``out`` that is a tier's directory, inside or above one,
    one ``force`` must not replace, an unknown format, a prefix no key is under, safetensors
    not installed), and what any load raises for a checkpoint that is not there or damaged in
    every tier (naming checkpoint, file and tier); ``out`` is then left as it was.
    """
    if format not in FORMATS:
        raise ConfigError(f"export format {format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, not {max_shard_size!r}")
    if strip_prefix is not None and not strip_prefix:
        raise ConfigError("strip_prefix must be a non-empty key prefix, e.g. 'model.'")
    if strip_prefix is not None and format == "dcp":
        raise ConfigError("strip_prefix is for format safetensors or torch: a dcp export keeps every key")
    store = Store.of(store)
    target = _target(out, force, store.tiers)
    save_file = _safetensors_writer() if format == "safetensors" else None
    options = ReaderOptions(thread_count=thread_count)
    metadata, manifest = _open(TieredReader(store, name=name, step=step, options=options))
    tensors, others = _entries(metadata)
    wanted, outside = _under(tensors if format == "safetensors" else [*tensors, *others], strip_prefix)
    if not wanted:
        raise ConfigError(
            f"no {'tensor' if format == 'safetensors' else 'key'} of the checkpoint is under "
            f"the prefix {strip_prefix!r}; its keys begin {sorted(tensors)[:3]}",
            checkpoint=manifest.name,
        )
    sizes = {key: _nbytes(metadata, key) for key in wanted}
    advance = counting(f"export {manifest.name}", sum(sizes.values()), progress)

    def load(keys: Collection[str]) -> dict[str, Any]:
        reader = TieredReader(store, name=manifest.name, options=options)
        return _load(reader, manifest, keys, advance)

    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.export-", dir=parent)
    try:
        if save_file is not None:
            files = _write_safetensors(work, wanted, sizes, strip_prefix, max_shard_size, load, save_file)
        elif format == "torch":
            files = _write_torch(work, wanted, strip_prefix, load)
        else:
            files = _write_dcp(work, load(wanted))
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
        skipped=tuple(sorted(others)) if format == "safetensors" else (),
        outside_prefix=tuple(sorted(outside)),
    )


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


def _nbytes(metadata: Metadata, key: str) -> int:
    value = metadata.state_dict_metadata[key]
    if not isinstance(value, TensorStorageMetadata):
        return 0
    return value.size.numel() * torch.empty((), dtype=value.properties.dtype).element_size()


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


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    flat, _ = flatten_state_dict(state)
    return flat


def _shards(keys: list[str], sizes: dict[str, int], cap: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for key in keys:
        if shards[-1] and used + sizes[key] > cap:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards


def _write_safetensors(
    work: str,
    keys: list[str],
    sizes: dict[str, int],
    prefix: str | None,
    cap: int,
    load: Callable[[Collection[str]], dict[str, Any]],
    save_file: Callable[..., None],
) -> list[str]:
    shards = _shards(keys, sizes, cap)
    count = len(shards)
    weight_map: dict[str, str] = {}
    files: list[str] = []
    for i, shard in enumerate(shards, 1):
        file = "model.safetensors" if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        flat = _flat(load(shard))
        tensors = {_strip(key, prefix): flat[key].contiguous() for key in shard}
        try:
            save_file(tensors, os.path.join(work, file), metadata={"format": "pt"})
        except Exception as err:  # a dtype safetensors has no name for, say
            raise ConfigError(f"safetensors cannot hold this checkpoint's tensors: {err}", file=file) from err
        del flat, tensors
        weight_map.update({_strip(key, prefix): file for key in shard})
        files.append(file)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(work, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return [*files, SAFETENSORS_INDEX]


def _strip(key: str, prefix: str | None) -> str:
    return key[len(prefix) :] if prefix else key


def _write_torch(
    work: str, keys: list[str], prefix: str | None, load: Callable[[Collection[str]], dict[str, Any]]
) -> list[str]:
    state = load(keys)
    if prefix is not None:
        flat = _flat(state)
        state = {_strip(key, prefix): flat[key] for key in keys}
    torch.save(state, os.path.join(work, TORCH_FILE))
    return [TORCH_FILE]


def _write_dcp(work: str, state: dict[str, Any]) -> list[str]:
    _save_state_dict(state, storage_writer=FileSystemWriter(work), no_dist=True)
    return sorted(os.listdir(work))


def _into_place(work: str, target: str) -> None:
    """``work`` renamed to ``target`` (a directory already there, empty or forced, replaced)."""
    for name in os.listdir(work):
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
