"""Gates: force an interleaving of real processes and threads at named fault points.

A gate is a directory. An operation armed with ``faults.arm(point, "block")`` (in a forked
child, or by ``tierstore.testing.faults.armed_env`` in a subprocess) and given ``gate.env`` stops at
``point`` and waits there; the test sees it arrive (:meth:`Gate.wait_reached`), runs other
operations to their end, then lets it go (:meth:`Gate.release`). One gate per actor lets a
test release actors one at a time even when they block at the same point::

    gate = Gate(tmp_path / "gate-a")
    pid = forked(lambda: migrate(...), block="transfer.after_chunk", env=gate.env)
    gate.wait_reached("transfer.after_chunk", pid=pid)
    ...run operation B to its end...
    gate.release("transfer.after_chunk")
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

from tierstore.storage import faults

__all__ = ["Gate", "GateNotReached", "exited"]

# A point never released fails its operation after this long, rather than hang the suite.
BLOCK_TIMEOUT = "60"


class GateNotReached(AssertionError):
    """The operation neither reached its gate nor ended in time."""


def exited(pid: int) -> bool:
    """Has child ``pid`` ended? (It is not reaped: the caller still waits for it.)"""
    result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return result is not None and result.si_pid == pid


class Gate:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        """What an operation's process needs in its environment to block at this gate."""
        return {faults.BLOCK_DIR_ENV: str(self.dir), faults.BLOCK_TIMEOUT_ENV: BLOCK_TIMEOUT}

    def reached(self, point: str) -> list[int]:
        """Pids of the processes that arrived at ``point`` (and may still be waiting)."""
        found = glob.glob(os.path.join(glob.escape(str(self.dir)), f"{glob.escape(point)}.*.reached"))
        return sorted(int(path.rsplit(".", 2)[-2]) for path in found)

    def wait_reached(self, point: str, timeout: float = 30.0, *, pid: int | None = None) -> bool:
        """Wait until some process is blocked at ``point``: ``True``; or, given the ``pid``
        of the forked child expected there, until it ends without reaching it: ``False``.
        Raises :class:`GateNotReached` when neither happens within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.reached(point):
                return True
            if pid is not None and exited(pid):
                return bool(self.reached(point))
            if time.monotonic() > deadline:
                raise GateNotReached(f"nothing reached fault point {point} within {timeout:.0f}s")
            time.sleep(0.002)

    def release(self, point: str) -> None:
        """Let every process blocked at (or yet to reach) ``point`` go on."""
        (self.dir / f"{point}.release").touch()

    def release_all(self) -> None:
        (self.dir / faults.RELEASE_ALL).touch()
