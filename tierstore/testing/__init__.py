"""The backend and cold-tier contracts as reusable pytest suites.

Every backend, built-in or plugin, proves the guarantees of :mod:`tierstore.storage.backend` by
subclassing :class:`BackendContract` and providing a fresh, empty backend::

    from tierstore.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            return MyBackend(f"my://{tmp_path}")

Class attributes tune it: ``large_size`` (bytes streamed by the large-file tests),
``stream_memory_limit`` (the most Python-heap growth allowed while streaming it) and
``versions`` (``True``: the backend must report object versions; a backend that reports
none is still correct, only slower to commit to, and the version tests then only check
that it says so consistently).

A cold-tier backend also proves that a cold tier which is down never blocks or breaks a save
by subclassing :class:`ColdTierContract` and providing its tier behind a fault proxy, a
:class:`ProxiedCold`::

    from tierstore.testing import ColdTierContract, ProxiedCold

    class MyProxiedCold(ProxiedCold):
        ...  # url, set_mode, options, requests, throttle_uploads, close

    class TestMyColdDown(ColdTierContract):
        @pytest.fixture
        def proxied_cold(self, tmp_path):
            cold = MyProxiedCold(str(tmp_path / "hot"), ...)
            yield cold
            cold.close()

Fault points are armed only from here, by tests: :mod:`tierstore.testing.faults` (``arm`` in
this process, ``armed_env`` for a process the test starts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierstore.testing.backend_contract import BackendContract, in_background, returns_within
    from tierstore.testing.cold_tier_contract import COLD_MODES, ColdTierContract, ProxiedCold
    from tierstore.testing.server_modes import ModesHandler, ServerModes, assert_stall_ends

__all__ = [
    "BackendContract",
    "ColdTierContract",
    "ProxiedCold",
    "COLD_MODES",
    "in_background",
    "returns_within",
    "ServerModes",
    "ModesHandler",
    "assert_stall_ends",
]

# Each name loads its own module on first use: the backend contract needs the storage layer
# only, the cold-tier contract torch and the whole of tierstore.
_WHERE = {
    "BackendContract": "backend_contract",
    "in_background": "backend_contract",
    "returns_within": "backend_contract",
    "ColdTierContract": "cold_tier_contract",
    "ProxiedCold": "cold_tier_contract",
    "COLD_MODES": "cold_tier_contract",
    "ServerModes": "server_modes",
    "ModesHandler": "server_modes",
    "assert_stall_ends": "server_modes",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
