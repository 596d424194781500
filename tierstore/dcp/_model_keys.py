"""Which tensors of a checkpoint are its model's weights, for a safetensors export that the
Hugging Face tools load as it is (:func:`tierstore.dcp.export.export`, issue 38).

**The model's prefix.** A training state saves its model beside its optimizer and the rest,
under one key: ``train.model.*`` beside ``train.optim.*`` (``CheckpointManager`` with a
``TrainingState`` given as ``{"train": state}``), ``model.*`` beside ``optim.*`` (DCP's own
examples). The model's prefix is the shallowest one ending in a ``model`` component whose
siblings are all parts a training state saves beside a model (:data:`BESIDE_MODEL`). A
checkpoint of a Hugging Face model's own state dict, ``model.layers.*`` beside
``lm_head.weight``, has none: every tensor is the model's. Two at one depth
(``student.model.``, ``teacher.model.``) are ambiguous: the caller names one.

**Tied weights.** A parameter two modules share (GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``) is saved by DCP under both names, as two copies; nothing in the
checkpoint says they were one but the optimizer: ``get_optimizer_state_dict`` keys each
parameter's state by its first name only. A model tensor without optimizer state whose dtype,
shape and bytes equal those of one with state is the tie's second name: it is left out, as
``save_pretrained`` leaves it out, and ``from_pretrained`` ties it again. Without optimizer
state beside the model (a model saved alone, or before its first step) both copies are
written; they load all the same.

Pure functions of the checkpoint's keys and metadata; the export reads the bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tierstore.errors import ConfigError

__all__ = ["BESIDE_MODEL", "model_prefix", "TieCandidates", "tie_candidates", "digest", "ties"]

# What training states save beside their model: TrainingState's parts (tierstore.resume.state
# .PARTS), torchtitan's (optimizer, lr_scheduler, dataloader, train_state), Lightning's.
BESIDE_MODEL = frozenset(
    {"optim", "optimizer", "optimizers", "scheduler", "lr_scheduler", "lr_schedulers", "step", "rng",
     "data", "dataloader", "extra", "train_state"}
)  # fmt: skip
_OPTIM = ("optim", "optimizer", "optimizers")


def model_prefix(keys: Iterable[str]) -> str | None:
    """The prefix of the model's keys among a checkpoint's tensor ``keys`` (``"train.model."``),
    or ``None`` when every tensor is the model's; :class:`ConfigError` when two models could be."""
    keys = list(keys)
    found: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        if "model" in parts[:-1]:
            depth = parts.index("model")
            found.setdefault(".".join(parts[: depth + 1]) + ".", depth)
    fitting = [prefix for prefix in found if _beside_a_model(prefix, keys)]
    if not fitting:
        return None
    depth = min(found[p] for p in fitting)
    shallowest = sorted(p for p in fitting if found[p] == depth)
    if len(shallowest) > 1:
        raise ConfigError(
            f"the checkpoint holds more than one model ({', '.join(shallowest)}): name the one to "
            "export (strip_prefix, --strip-prefix) or export every tensor (all_keys, --all)"
        )
    return shallowest[0]


def _beside_a_model(prefix: str, keys: list[str]) -> bool:
    """Whether every key beside ``prefix`` (under its parent, not under it) is a part a training
    state saves beside a model."""
    parent = prefix[: -len("model.")]
    beside = (key[len(parent) :] for key in keys if key.startswith(parent) and not key.startswith(prefix))
    return all(rest.split(".", 1)[0] in BESIDE_MODEL for rest in beside)


@dataclass(frozen=True)
class TieCandidates:
    """Model tensors that may be a tie's second name (``second``: key -> the keys it may equal);
    :func:`ties` decides from their digests. ``keys`` are every key whose bytes are needed."""

    second: Mapping[str, tuple[str, ...]]

    @property
    def keys(self) -> list[str]:
        return sorted({*self.second, *(k for firsts in self.second.values() for k in firsts)})


def tie_candidates(metadata: Metadata, model_keys: Iterable[str], prefix: str) -> TieCandidates:
    """The model tensors (``model_keys``, under ``prefix``) without optimizer state, each with
    the tensors of its dtype and shape that have some (module docstring)."""
    tensors = metadata.state_dict_metadata
    optimized = _optimized(tensors, prefix)
    if not optimized:
        return TieCandidates({})
    shape: dict[str, tuple[object, ...]] = {}
    for key in model_keys:
        value = tensors[key]
        assert isinstance(value, TensorStorageMetadata)
        shape[key] = (value.properties.dtype, tuple(value.size))
    firsts = [key for key in shape if key[len(prefix) :] in optimized]
    second = {
        key: tuple(first for first in firsts if shape[first] == shape[key])
        for key in shape
        if key[len(prefix) :] not in optimized
    }
    return TieCandidates({key: firsts for key, firsts in second.items() if firsts})


def _optimized(tensors: Mapping[str, object], prefix: str) -> set[str]:
    """The parameter names the optimizer beside the model at ``prefix`` holds state for:
    ``<parent>optim.state.<name>.<exp_avg|...>`` (``get_optimizer_state_dict``'s keys)."""
    if not prefix.endswith("model."):
        return set()
    parent = prefix[: -len("model.")]
    heads = tuple(f"{parent}{optim}.state." for optim in _OPTIM)
    return {
        key[len(head) :].rsplit(".", 1)[0]
        for key in tensors
        for head in heads
        if key.startswith(head) and "." in key[len(head) :]
    }


def digest(tensor: torch.Tensor) -> str:
    """A digest of ``tensor``'s bytes."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=32).hexdigest()


def ties(candidates: TieCandidates, digests: Mapping[str, str]) -> dict[str, str]:
    """``{second: first}``: each candidate whose bytes' digest equals one of its firsts'."""
    found: dict[str, str] = {}
    for key, firsts in sorted(candidates.second.items()):
        same = [first for first in firsts if digests[first] == digests[key]]
        if same:
            found[key] = same[0]
    return found
