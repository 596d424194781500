"""The flat module paths of 0.1 still import, warn, and are the very modules at their new paths."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import tierstore
from tierstore._compat import MOVED

_CHECK = """
import importlib, json, sys, warnings
import tierstore
from tierstore._compat import MOVED
seen = {}
for old, new in MOVED.items():
    target = importlib.import_module(new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    seen[old] = {
        "warned": [str(w.message) for w in caught if w.category is DeprecationWarning],
        "same": module is target and module.__spec__.name == new,
    }
# ``import tierstore.prune`` must not replace the function tierstore.prune with the module
seen["api"] = [tierstore.prune.__module__, tierstore.restore.__module__]
print(json.dumps(seen))
"""


def test_old_paths_warn_and_are_the_new_modules() -> None:
    # a fresh interpreter: in this one, other tests have imported the new paths already
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    for old, new in MOVED.items():
        assert seen[old]["warned"] == [f"{old} moved to {new}; import it from there (the old path "
                                       "goes in 0.4)"], old
        assert seen[old]["same"], old
    assert seen["api"] == ["tierstore.lifecycle.prune", "tierstore.tiers.restore"]


def test_every_old_module_has_a_new_home() -> None:
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new


def test_the_public_api_is_unchanged() -> None:
    for name in tierstore.__all__:
        assert getattr(tierstore, name) is not None, name
    assert callable(tierstore.prune) and callable(tierstore.restore)
