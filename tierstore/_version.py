from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tierstore")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"


def producer() -> str:
    """What wrote a manifest, for humans reading it."""
    import torch

    return f"tierstore {__version__}; torch {torch.__version__}"
