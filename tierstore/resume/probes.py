"""What a probe is, and how a fresh process finds it (the user's code, named by
``"module:function"`` or ``"path/to/file.py:function"``); see :mod:`tierstore.resume.check`.
Kept apart from the check and from the fresh process (:mod:`tierstore.resume.probe`), which
both need it, so neither imports the other.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore.errors import ConfigError

__all__ = ["Probe", "ProbeFactory", "probe_spec", "load_probe"]

ProbeFactory = Callable[[], "Probe"]


@dataclass(frozen=True)
class Probe:
    """How to rebuild the training objects and measure them (see the module docstring).

    Attributes:
        build: makes fresh objects to load the checkpoint into: the same dict, with the same
            keys and ``Stateful`` objects, that was saved. Runs in the fresh process, after
            ``torch.distributed`` is initialised.
        loss: the loss on one fixed batch, given such a dict (live or freshly loaded).
    """

    build: Callable[[], dict[str, Any]]
    loss: Callable[[dict[str, Any]], Any]


# -- naming a probe so a fresh process can import it ------------------------------------------


def probe_spec(probe: str | ProbeFactory) -> str:
    """``"module:function"`` for a probe function (a file path if it lives in ``__main__``)."""
    if isinstance(probe, str):
        return probe
    module, name = getattr(probe, "__module__", None), getattr(probe, "__qualname__", "")
    if not module or not name or "<" in name:
        raise ConfigError(f"probe {probe!r} must be a module-level function (a fresh process imports it)")
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise ConfigError(
                "a probe defined in an interactive __main__ cannot be imported; put it in a module"
            )
        return f"{os.path.abspath(main_file)}:{name}"
    return f"{module}:{name}"


def load_probe(spec: str) -> ProbeFactory:
    """Import the probe function ``spec`` names (``module:function`` or ``file.py:function``)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"probe {spec!r} is not 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        # Imported under a private name, so the script's `if __name__ == "__main__"` does not run;
        # its own directory goes on the path, as `python file.py` puts it, for its sibling imports.
        here = str(Path(target).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        module_spec = importlib.util.spec_from_file_location("_tierstore_probe", target)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"cannot import probe file {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"probe {spec!r} is not callable")
    factory: ProbeFactory = obj
    return factory
