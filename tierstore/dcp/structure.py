"""The structure of a saved state as a fingerprint (docs/format.md, ``fingerprint``).

Two saves of the same model and optimizer have the same keys, global shapes and dtypes
whatever their values: the fingerprint of that structure, recorded in each manifest, tells
"this checkpoint is of the state I am loading into" from "another model's" without reading
``.metadata``. The coordinator's writer takes it from DCP's global ``Metadata``; a load that
fails takes the state's from its load planner, in the same terms, to say whether the two
differ. Both come to :func:`tierstore.format.manifest_format.structure_fingerprint`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tierstore.format.manifest_format import structure_fingerprint

__all__ = ["of_metadata", "of_state"]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def of_metadata(metadata: Metadata) -> str:
    """The fingerprint of the state ``metadata`` (DCP's global metadata of a save) describes."""

    def items() -> Iterator[tuple[str, str | None, tuple[int, ...] | None]]:
        for key, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, TensorStorageMetadata):
                yield key, _dtype(stored.properties.dtype), tuple(stored.size)
            else:  # BytesStorageMetadata: an object DCP pickled
                yield key, None, None

    return structure_fingerprint(items())


def of_state(flat: Mapping[str, Any]) -> str:
    """The fingerprint a save of ``flat`` would record: ``flat`` is a state as DCP's planners
    hold it (flattened keys; a ``DTensor`` or ``ShardedTensor`` by its global shape)."""

    def items() -> Iterator[tuple[str, str | None, tuple[int, ...] | None]]:
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
                yield key, _dtype(value.dtype), tuple(value.shape)
                continue
            if type(value).__name__ == "ShardedTensor":  # torch's private class, by name
                described: Any = value.metadata()
                yield key, _dtype(described.tensor_properties.dtype), tuple(described.size)
            else:  # an object DCP pickles
                yield key, None, None

    return structure_fingerprint(items())
