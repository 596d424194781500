"""Load DCP's pickled ``.metadata`` without running arbitrary code.

Even after the manifest vouches for its bytes, ``.metadata`` is a pickle: a forged
checkpoint could carry code. This unpickler only builds the types DCP metadata is made of.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["load_metadata"]

_ALLOWED: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,  # every name: dataclasses and enums
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, set())
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        if allowed is None or (allowed and name in allowed):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(data: bytes) -> Any:
    return _MetadataUnpickler(io.BytesIO(data)).load()
