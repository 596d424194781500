"""Named fault points that crash tests arm; free when nothing is armed.

Code marks the moments a crash could matter with ``faults.point("writer.after_file_write")``.
A test arms points to raise :class:`~tierstore.errors.FaultInjected`, to ``SIGKILL`` the
process (or its whole process group), to exit, to raise ``OSError(ENOSPC)`` (a full disk), to
sleep (``TIERSTORE_FAULT_SLEEP`` seconds, default 2: widens a race window) or to block until the
test releases it. Only a test arms them, through :mod:`tierstore.testing.faults`: in code
(:func:`arm`), or in a child process it starts with that module's ``armed_env``. This module
reads no variable that arms anything; a production process never fires a point.

A spec is ``pattern[@hit]=action`` (pattern in :mod:`fnmatch` syntax, ``hit`` counted per
spec from 1, default 1), several separated by ``;``. With :func:`trace` every point passed is
appended to a file (one name per line, with the pid), which is how the crash suite learns the
points an operation passes and picks one by index.

``block`` forces an interleaving across threads and processes (forked or spawned): the point
creates ``<dir>/<point>.<pid>.reached`` in the directory named by ``TIERSTORE_FAULT_BLOCK_DIR``,
then waits until ``<dir>/<point>.release`` or ``<dir>/release-all`` exists (polling every few
milliseconds). A test starts operation A blocked at a point, runs operation B to its end,
releases A and checks the outcome (``tests/crash/gates.py``). A point never released raises
:class:`~tierstore.errors.FaultInjected` after ``TIERSTORE_FAULT_BLOCK_TIMEOUT`` seconds
(default 60), so a broken test fails instead of hanging. Those two, and the sleep, are
settings (:mod:`tierstore.settings`) consulted only when an armed point fires.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import threading
import time
from dataclasses import dataclass

from tierstore import settings
from tierstore.errors import ConfigError, FaultInjected

__all__ = [
    "point",
    "arm",
    "disarm",
    "armed",
    "parse_spec",
    "trace",
    "ACTIONS",
    "BLOCK_DIR_ENV",
    "BLOCK_TIMEOUT_ENV",
    "RELEASE_ALL",
]

ACTIONS = ("raise", "kill", "killgroup", "exit", "enospc", "sleep", "block")
SLEEP_ENV = settings.FAULT_SLEEP.variable
BLOCK_DIR_ENV = settings.FAULT_BLOCK_DIR.variable
BLOCK_TIMEOUT_ENV = settings.FAULT_BLOCK_TIMEOUT.variable
RELEASE_ALL = "release-all"
_BLOCK_POLL = 0.005


@dataclass
class _Spec:
    pattern: str
    hit: int
    action: str
    seen: int = 0


# Process-global by nature: a fault point must be reachable from any code path without
# threading a handle through it. Empty (the normal case) costs one truth test per point.
_specs: list[_Spec] = []
_trace_path: str | None = None
_lock = threading.Lock()


def parse_spec(text: str) -> list[_Spec]:
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        target, _, action = part.partition("=")
        pattern, _, hit = target.partition("@")
        action = action or "raise"
        if action not in ACTIONS or not pattern or (hit and not hit.isdigit()):
            raise ConfigError(f"bad fault spec {part!r}: want pattern[@hit]={'|'.join(ACTIONS)}")
        specs.append(_Spec(pattern=pattern, hit=int(hit or 1), action=action))
    return specs


def arm(pattern: str, action: str = "raise", *, hit: int = 1) -> None:
    """Arm ``pattern`` to fire ``action`` on its ``hit``-th pass."""
    _specs.extend(parse_spec(f"{pattern}@{hit}={action}"))


def trace(path: str | os.PathLike[str] | None) -> None:
    """Append every point passed from now on to ``path`` (``None``: stop tracing)."""
    global _trace_path
    _trace_path = None if path is None else os.fspath(path)


def disarm() -> None:
    """Disarm every point and stop tracing."""
    global _trace_path
    _specs.clear()
    _trace_path = None


def armed() -> bool:
    return bool(_specs) or _trace_path is not None


def point(name: str) -> None:
    """Mark a fault point; does nothing unless armed or traced."""
    if not _specs and _trace_path is None:
        return
    _fire(name)


def _fire(name: str) -> None:
    with _lock:
        if _trace_path is not None:
            with open(_trace_path, "a") as trace:
                trace.write(f"{os.getpid()} {name}\n")
        action = None
        for spec in _specs:
            if fnmatch.fnmatchcase(name, spec.pattern):
                spec.seen += 1
                if spec.seen == spec.hit:
                    action = spec.action
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "killgroup":  # the whole job at once, as when a node loses power
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif action == "exit":
        os._exit(17)
    elif action == "raise":
        raise FaultInjected(f"fault injected at {name}")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    elif action == "sleep":
        time.sleep(settings.seconds(settings.FAULT_SLEEP))
    elif action == "block":
        _block(name)


def _block(name: str) -> None:
    """Wait, outside the lock (other threads pass their points meanwhile), for a release."""
    directory = settings.read(settings.FAULT_BLOCK_DIR)
    if not directory:
        raise ConfigError(f"fault point {name} armed to block, but {BLOCK_DIR_ENV} is not set")
    timeout = settings.seconds(settings.FAULT_BLOCK_TIMEOUT)
    releases = (os.path.join(directory, f"{name}.release"), os.path.join(directory, RELEASE_ALL))
    reached = os.path.join(directory, f"{name}.{os.getpid()}.reached")
    with open(reached + ".tmp", "w"):
        pass
    os.replace(reached + ".tmp", reached)  # whoever sees it sees the process already waiting
    deadline = time.monotonic() + timeout
    while not any(os.path.exists(path) for path in releases):
        if time.monotonic() > deadline:
            raise FaultInjected(f"fault point {name} blocked for {timeout:.0f}s and was never released")
        time.sleep(_BLOCK_POLL)
