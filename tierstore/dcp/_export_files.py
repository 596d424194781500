"""The files of an export (:func:`tierstore.dcp.export.export`), written into its work
directory: one function per format, and the ``config.json`` copied beside a safetensors export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from tierstore.errors import ConfigError

__all__ = [
    "Writing",
    "read_config",
    "write_safetensors",
    "write_torch",
    "write_dcp",
    "flat",
    "shards",
    "strip",
    "TORCH_FILE",
    "SAFETENSORS_INDEX",
    "CONFIG_FILE",
]

TORCH_FILE = "state_dict.pt"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Writing:
    """One export's writing: its work directory, the prefix it strips, the dtype it casts
    floating tensors to, and how it loads keys (counting progress)."""

    work: str
    prefix: str | None
    cast: torch.dtype | None
    load: Callable[[Collection[str]], dict[str, Any]]

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        if self.cast is not None and value.is_floating_point():
            value = value.to(self.cast)
        return value.contiguous()

    def tree(self, value: Any) -> Any:
        """``value`` with each floating tensor in it cast."""
        if isinstance(value, torch.Tensor):
            return self.tensor(value) if self.cast is not None else value
        if isinstance(value, dict):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree(v) for v in value)
        return value


def read_config(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the ``config.json`` at ``path``, checked to be a JSON object; copied as
    they are (the user's file, key order and all)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        parsed = json.loads(data)
    except (OSError, ValueError) as err:
        raise ConfigError(f"config {os.fspath(path)!r} is not a readable JSON file: {err}") from err
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"config {os.fspath(path)!r} holds a JSON {type(parsed).__name__}, not the object of a "
            "Hugging Face config.json"
        )
    return data


def flat(state: dict[str, Any]) -> dict[str, Any]:
    entries, _ = flatten_state_dict(state)
    return entries


def shards(keys: list[str], sizes: dict[str, int], cap: int) -> list[list[str]]:
    """``keys`` in order, cut into groups of at most ``cap`` bytes (a larger key alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for key in keys:
        if groups[-1] and used + sizes[key] > cap:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += sizes[key]
    return groups


def write_safetensors(
    writing: Writing, keys: list[str], sizes: dict[str, int], cap: int, save_file: Callable[..., None]
) -> list[str]:
    parts = shards(keys, sizes, cap)
    count = len(parts)
    weight_map: dict[str, str] = {}
    files: list[str] = []
    prefix = writing.prefix
    for i, shard in enumerate(parts, 1):
        file = "model.safetensors" if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        loaded = flat(writing.load(shard))
        tensors = {strip(key, prefix): writing.tensor(loaded[key]) for key in shard}
        try:
            save_file(tensors, os.path.join(writing.work, file), metadata={"format": "pt"})
        except Exception as err:  # a dtype safetensors has no name for, say
            raise ConfigError(f"safetensors cannot hold this checkpoint's tensors: {err}", file=file) from err
        del loaded, tensors
        weight_map.update({strip(key, prefix): file for key in shard})
        files.append(file)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(writing.work, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return [*files, SAFETENSORS_INDEX]


def strip(key: str, prefix: str | None) -> str:
    return key[len(prefix) :] if prefix else key


def write_torch(writing: Writing, keys: list[str]) -> list[str]:
    state = writing.load(keys)
    if writing.prefix is not None:
        entries = flat(state)
        state = {strip(key, writing.prefix): entries[key] for key in keys}
    torch.save(writing.tree(state), os.path.join(writing.work, TORCH_FILE))
    return [TORCH_FILE]


def write_dcp(work: str, state: dict[str, Any]) -> list[str]:
    _save_state_dict(state, storage_writer=FileSystemWriter(work), no_dist=True)
    return sorted(os.listdir(work))
