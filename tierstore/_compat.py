"""Old module paths, kept importable with a :class:`DeprecationWarning` (removed in 0.4).

Until 0.2 every module sat flat under ``tierstore``; they are now grouped by what they own
(``docs/design.md``, "Module map"). ``import tierstore.writer`` still works: it warns and
yields the very module object at its new path, so its classes, functions and monkeypatched
names are the same ones.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

MOVED: dict[str, str] = {
    "tierstore.backend": "tierstore.storage.backend",
    "tierstore.registry": "tierstore.storage.registry",
    "tierstore.faults": "tierstore.storage.faults",
    "tierstore.layout": "tierstore.commit.layout",
    "tierstore.manifest": "tierstore.commit.manifest",
    "tierstore.writer": "tierstore.commit.writer",
    "tierstore.reader": "tierstore.commit.reader",
    "tierstore.catalog": "tierstore.tiers.catalog",
    "tierstore.migrator": "tierstore.tiers.migrator",
    "tierstore.marks": "tierstore.tiers.marks",
    "tierstore.pending": "tierstore.tiers.status",
    "tierstore.restore": "tierstore.tiers.restore",
    "tierstore.retention": "tierstore.lifecycle.retention",
    "tierstore.prune": "tierstore.lifecycle.prune",
    "tierstore.gc": "tierstore.lifecycle.gc",
    "tierstore.leases": "tierstore.lifecycle.leases",
    "tierstore.scrub": "tierstore.lifecycle.scrub",
    "tierstore.state": "tierstore.resume.state",
    "tierstore.data": "tierstore.resume.data",
    "tierstore.verify": "tierstore.resume.check",
    "tierstore.resume_report": "tierstore.resume.report",
    "tierstore.cadence": "tierstore.resume.cadence",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path, and loads it as the module at the new one."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in 0.4)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system overwrites it on the way out
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec  # it stays the module at its new path


class _Package(types.ModuleType):
    """``tierstore`` itself: an old-path import must not shadow a function of the same name.

    ``import tierstore.prune`` sets the attribute ``prune`` of the package to the module it
    loads; ``tierstore.prune`` is the function (and ``tierstore.restore`` likewise).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ != f"{self.__name__}.{name}":
            return  # an alias landing on the package: keep what the package defines
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
    package.__class__ = _Package
