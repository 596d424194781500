"""Every setting tierstore reads from the environment: read here, and nowhere else.

A setting is read when it is used, not at import, so a launcher or a test that sets one
before building the object that uses it is heard; a value that does not parse is a
:class:`~tierstore.errors.ConfigError` naming the variable. An argument given in code always
wins over the variable. docs/operations.md#settings lists them in one table, and a test
checks that it lists exactly :data:`SETTINGS`.

Fault injection is not a setting: it is armed only by tests, through
:mod:`tierstore.testing.faults`. The ``TIERSTORE_FAULT_*`` options here only shape what a
fault point a test armed does when it fires; with nothing armed they are never read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tierstore.errors import ConfigError

__all__ = [
    "Setting",
    "SETTINGS",
    "MANIFEST_PART_RANKS",
    "MAX_FILES_PER_DIR",
    "RUN_LOCK_TTL",
    "EXIT_WAIT",
    "FAULT_SLEEP",
    "FAULT_BLOCK_DIR",
    "FAULT_BLOCK_TIMEOUT",
    "read",
    "seconds",
]


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default as documented, what it sets."""

    variable: str
    default: str
    meaning: str


MANIFEST_PART_RANKS = Setting(
    "TIERSTORE_MANIFEST_PART_RANKS",
    "1024",
    "ranks per manifest part: a save of more ranks commits a two-level manifest "
    "(`WriterOptions(manifest_part_ranks=)` wins)",
)
MAX_FILES_PER_DIR = Setting(
    "TIERSTORE_MAX_FILES_PER_DIR",
    "4096",
    "shard files per hot directory before a save spreads them over `r<k>/` subdirectories "
    "(`WriterOptions(max_files_per_dir=)` wins)",
)
RUN_LOCK_TTL = Setting(
    "TIERSTORE_RUN_LOCK_TTL",
    "120",
    "seconds after its last heartbeat that a killed job's run lock is forgotten (at most 86400)",
)
EXIT_WAIT = Setting(
    "TIERSTORE_EXIT_WAIT",
    "30",
    "seconds the exit hook waits at most for uploads in flight at interpreter exit; what is "
    "left stays pending in the hot tier, named at ERROR",
)
FAULT_SLEEP = Setting(
    "TIERSTORE_FAULT_SLEEP", "2", "tests only: seconds a fault point armed to `sleep` sleeps"
)
FAULT_BLOCK_DIR = Setting(
    "TIERSTORE_FAULT_BLOCK_DIR",
    "(none)",
    "tests only: the gate directory a fault point armed to `block` waits on (tests/crash/gates.py)",
)
FAULT_BLOCK_TIMEOUT = Setting(
    "TIERSTORE_FAULT_BLOCK_TIMEOUT",
    "60",
    "tests only: seconds a fault point armed to `block` waits before it raises FaultInjected",
)

SETTINGS: tuple[Setting, ...] = (
    MANIFEST_PART_RANKS,
    MAX_FILES_PER_DIR,
    RUN_LOCK_TTL,
    EXIT_WAIT,
    FAULT_SLEEP,
    FAULT_BLOCK_DIR,
    FAULT_BLOCK_TIMEOUT,
)
_BY_NAME = {setting.variable: setting for setting in SETTINGS}


def read(setting: Setting | str) -> str | None:
    """The variable's value, stripped; ``None`` when unset or empty. A name that is not one
    of :data:`SETTINGS` is a ``KeyError``: every variable read is listed."""
    variable = setting.variable if isinstance(setting, Setting) else _BY_NAME[setting].variable
    value = os.environ.get(variable, "").strip()
    return value or None


def seconds(setting: Setting) -> float:
    """The variable as a number of seconds >= 0, else its default."""
    value = read(setting) or setting.default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 <= number < float("inf"):  # nan fails too
        raise ConfigError(f"{setting.variable}={value!r} is not a number of seconds >= 0")
    return number
