"""This process's migrators: one per (hot, cold) pair, forgotten in a forked child, drained
at exit.

Writers are built per save, but the uploads they hand over outlive them, so the migrator a
writer uses is kept here, per process. Nothing else is global: a forked child starts with none
(threads do not survive fork), and an exit hook gives uploads still in flight a bounded chance
to finish (``TIERSTORE_EXIT_WAIT`` seconds, default 600) before the process goes; whatever
is left is stopped (nothing of it is attempted after that) and stays pending in the tiers,
for the next job's manager or ``tierstore migrate``.

The hook runs when the interpreter begins to shut down, before ``concurrent.futures`` refuses
new work (``threading``'s exit hooks, not ``atexit``'s, which run after it): uploads that use
a thread pool (the S3 plugin's parts) still work while it waits. A ``CheckpointManager``
closed by the program has waited (boundedly) already, and left nothing for the hook.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time

from tierstore.migration.migrator import MigrationConfig, Migrator
from tierstore.tiers.tier import Tier

__all__ = ["migrator_for", "migrators_of", "active_migrators", "drain", "EXIT_WAIT_ENV"]

log = logging.getLogger(__name__)

EXIT_WAIT_ENV = "TIERSTORE_EXIT_WAIT"

_MIGRATORS: dict[tuple[str, str, str], Migrator] = {}
_MIGRATORS_LOCK = threading.Lock()


def _tier_id(tier: Tier) -> str:
    return json.dumps([tier.url, tier.options], sort_keys=True, default=repr)


def migrator_for(hot: Tier, cold: Tier, config: MigrationConfig | None = None) -> Migrator:
    """This process's migrator for ``hot`` -> ``cold``, created on first use.

    The first caller's ``config`` wins.
    """
    key = (_tier_id(hot), _tier_id(cold), "")
    with _MIGRATORS_LOCK:
        migrator = _MIGRATORS.get(key)
        if migrator is None:
            migrator = _MIGRATORS[key] = Migrator(hot, cold, config)
        return migrator


def migrators_of(hot: Tier, cold: Tier) -> list[Migrator]:
    """This process's migrator for exactly these tiers (URL and options), if it has one: not
    one of another cold tier under the same URL (another endpoint, other credentials)."""
    key = (_tier_id(hot), _tier_id(cold), "")
    with _MIGRATORS_LOCK:
        migrator = _MIGRATORS.get(key)
    return [] if migrator is None else [migrator]


def active_migrators() -> list[Migrator]:
    with _MIGRATORS_LOCK:
        return list(_MIGRATORS.values())


def drain(timeout: float | None) -> bool:
    """Wait for every migrator of this process, ``timeout`` seconds in all (``None``: as
    long as it takes); ``False`` if work was still in flight when it ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    drained = True
    for migrator in active_migrators():
        drained &= migrator.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return drained


def _forget_after_fork() -> None:
    # Threads do not survive fork: a child starts with no migrators (and no stale locks).
    global _MIGRATORS_LOCK
    _MIGRATORS.clear()
    _MIGRATORS_LOCK = threading.Lock()


def _drain_at_exit() -> None:
    if not any(m.pending() for m in active_migrators()):
        return
    timeout = float(os.environ.get(EXIT_WAIT_ENV, "600"))
    log.warning("waiting up to %.0fs for checkpoint migrations before exit", timeout)
    if not drain(timeout):
        left = sorted({s.name for m in active_migrators() for s in m.pending()})
        for migrator in active_migrators():
            migrator.stop()  # nothing more is attempted once the interpreter shuts down
        log.error(
            "exiting with the migrations of %s unfinished: they stay pending in the hot "
            "tier; the next job's CheckpointManager or `tierstore migrate` finishes them",
            ", ".join(left),
        )


def _register_exit_hook() -> None:
    # concurrent.futures registers its own shutdown with threading first (importing it
    # does), so ours, registered after, runs before it (the hooks run last in, first out).
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_drain_at_exit)
    else:  # an interpreter without the hook: atexit, where thread pools refuse new work
        atexit.register(_drain_at_exit)


os.register_at_fork(after_in_child=_forget_after_fork)
_register_exit_hook()
