"""This process's migrators: one per (hot, cold) pair and migration config, forgotten in a
forked child, drained at exit, boundedly.

Writers are built per save, but the uploads they hand over outlive them, so the migrator a
writer uses is kept here, per process. Each config gets its own migrator: no caller's config
is ignored because another came first (a bandwidth cap is a migrator's, so two configs on one
pair of tiers each get theirs). Nothing else is global: a forked child starts with none
(threads do not survive fork), and a process that never migrates registers no exit hook.

**The exit wait.** When the interpreter begins to shut down with uploads still in flight, an
exit hook gives them a bounded chance to finish: at most ``EXIT_WAIT`` seconds (30; the
``TIERSTORE_EXIT_WAIT`` variable sets another bound), and never longer than the
``exit_wait=`` a caller of :func:`migrator_for` asked for (a ``CheckpointManager`` asks for
its ``close_timeout``). A plain ``dcp.save`` script whose cold tier never answers so exits
in about half a minute, never minutes. Whatever is left is stopped (nothing of it is
attempted after that; uploads run on daemon threads) and stays committed and pending in the
hot tier, named at ERROR, for the next job's manager or ``tierstore migrate``. A
``CheckpointManager`` closed by the program has waited (at most its ``close_timeout``)
already and left nothing for the hook.

The hook runs when the interpreter begins to shut down, before ``concurrent.futures`` refuses
new work (``threading``'s exit hooks, not ``atexit``'s, which run after it): uploads that use
a thread pool (the S3 plugin's parts) still work while it waits.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time

from tierstore import settings
from tierstore.errors import ConfigError
from tierstore.migration.migrator import MigrationOptions, Migrator
from tierstore.tiers.tier import Tier

__all__ = ["migrator_for", "migrators_of", "active_migrators", "drain", "EXIT_WAIT", "EXIT_WAIT_ENV"]

log = logging.getLogger(__name__)

EXIT_WAIT_ENV = settings.EXIT_WAIT.variable
# Seconds the exit hook waits at most: a script that never closes anything must not sit for
# minutes at exit on a cold tier that never answers (issue 36, item 4).
EXIT_WAIT = float(settings.EXIT_WAIT.default)

_Pair = tuple[str, str]  # the tiers' identities: URL and options, hot then cold

_MIGRATORS: dict[_Pair, list[Migrator]] = {}
_MIGRATORS_LOCK = threading.Lock()
_EXIT_WAITS: dict[int, float] = {}  # id(migrator): the tightest exit_wait= asked of it
_HOOKED = False  # the exit hook, registered with the process's first migrator


def _tier_id(tier: Tier) -> str:
    return json.dumps([tier.url, tier.options], sort_keys=True, default=repr)


def migrator_for(
    hot: Tier, cold: Tier, config: MigrationOptions | None = None, *, exit_wait: float | None = None
) -> Migrator:
    """This process's migrator for ``hot`` -> ``cold`` with ``config`` (``None``: the default
    ``MigrationOptions()``), created on first use.

    Every config gets its own: a writer asking for another config than the migrator already
    running for its tiers gets a migrator of its own, which uploads its checkpoints with that
    config (its concurrency, bandwidth cap, retries), never one silently ignored.
    ``exit_wait``: the exit hook waits at most this many seconds for this migrator's uploads
    (the tightest any caller asked for, and never more than ``EXIT_WAIT``).
    """
    wanted = config if config is not None else MigrationOptions()
    pair = (_tier_id(hot), _tier_id(cold))
    with _MIGRATORS_LOCK:
        running = _MIGRATORS.setdefault(pair, [])
        migrator = next((m for m in running if m.config == wanted), None)
        if migrator is None:
            migrator = Migrator(hot, cold, wanted)
            running.append(migrator)
            _hook_exit()
        if exit_wait is not None:
            bound = min(max(0.0, float(exit_wait)), _EXIT_WAITS.get(id(migrator), float("inf")))
            _EXIT_WAITS[id(migrator)] = bound
        return migrator


def migrators_of(hot: Tier, cold: Tier) -> list[Migrator]:
    """This process's migrators for exactly these tiers (URL and options), one per config:
    not those of another cold tier under the same URL (another endpoint, other credentials)."""
    with _MIGRATORS_LOCK:
        return list(_MIGRATORS.get((_tier_id(hot), _tier_id(cold)), ()))


def active_migrators() -> list[Migrator]:
    with _MIGRATORS_LOCK:
        return [migrator for running in _MIGRATORS.values() for migrator in running]


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
    _EXIT_WAITS.clear()
    _MIGRATORS_LOCK = threading.Lock()


def exit_wait() -> float:
    """Seconds the exit hook would wait now, at most: ``EXIT_WAIT`` (or
    ``TIERSTORE_EXIT_WAIT``), bounded by every ``exit_wait=`` asked of a migrator with work."""
    try:
        bound = settings.seconds(settings.EXIT_WAIT)
    except ConfigError as err:  # at exit, nobody is left to raise it to
        log.error("%s; waiting at most the default %gs", err, EXIT_WAIT)
        bound = EXIT_WAIT
    busy = [id(migrator) for migrator in active_migrators() if migrator.pending()]
    return min([bound, *(_EXIT_WAITS[key] for key in busy if key in _EXIT_WAITS)])


def _drain_at_exit() -> None:
    pending = sorted({s.name for m in active_migrators() for s in m.pending()})
    if not pending:
        return
    timeout = exit_wait()
    log.warning(
        "waiting up to %gs (%s) at exit for the migrations of %s to the cold tier",
        timeout,
        EXIT_WAIT_ENV,
        ", ".join(pending),
    )
    if not drain(timeout):
        left = sorted({s.name for m in active_migrators() for s in m.pending()})
        for migrator in active_migrators():
            migrator.stop()  # nothing more is attempted once the interpreter shuts down
        log.error(
            "exiting with the migrations of %s unfinished: they stay pending in the hot "
            "tier; the next job's CheckpointManager or `tierstore migrate` finishes them",
            ", ".join(left),
        )


def _hook_exit() -> None:
    """Register the exit hook, once, with the first migrator (called holding the lock): a
    process that never migrates has none."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    # concurrent.futures registers its own shutdown with threading first (importing it
    # does), so ours, registered after, runs before it (the hooks run last in, first out).
    # threading's hook is private, but the only one that runs while thread pools still take
    # work: the S3 plugin's multipart uploads need one while the hook waits.
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_drain_at_exit)
        except RuntimeError:  # the interpreter is shutting down already: no exit left to wait at
            pass
    else:  # an interpreter without the hook: atexit, where thread pools refuse new work
        atexit.register(_drain_at_exit)


os.register_at_fork(after_in_child=_forget_after_fork)
