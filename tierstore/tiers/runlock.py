"""Run locks: "a job is saving into this hot directory", so a second job is noticed at start.

Two jobs saving into one hot directory harm each other quietly: each prunes by its own
retention and so deletes the other's checkpoints, their step names collide (the later save
of a step is refused), and a resume picks whichever job's checkpoint is newest. Nothing is
refused here (the store stays consistent: design.md invariants 1-3 hold across jobs); the
second job is told, loudly and once, so a person can stop it.

A job's coordinator publishes ``runs/<run>/<beat>.json`` (:func:`~tierstore.format.layout.run_lock_key`:
host, pid, a job label, ttl) when it starts, then lists ``runs/``: every *live* lock of
another job is named in one ``logging.WARNING`` naming both jobs and the directory. Every
``ttl / 4`` (the heartbeat) it publishes the next beat and deletes the one before (``publish``
never replaces an object, and the new one first leaves no moment without a lock), lists
again, and warns once about each job that arrived later. :meth:`RunLock.release` (``CheckpointManager.close``,
or interpreter exit) stops the heartbeat and deletes the lock.

**Liveness is judged by the store's clock**, as leases are (:mod:`tierstore.tiers.leases`):
a lock is live while ``store_now - mtime < ttl``, ``mtime`` stamped by the store on its
newest beat and ``store_now`` by :func:`~tierstore.tiers.leases.store_time`. So a
SIGKILLed job's lock stops counting ``ttl`` seconds after its last heartbeat, whatever the
machines' clocks say. One shortcut: a lock written on this machine (same boot id, not just
the same host name, which machines can share) in this pid namespace by a process that no
longer exists is dead at once, so a job restarted on the same machine right after a crash
is not warned about its own corpse. Expired locks are deleted by whoever finds them; ``gc``
leaves ``runs/`` alone.

Best effort: a tier that refuses the lock (read-only) or cannot be listed gets a debug line,
never an error; the run lock never fails or delays a save. A lock this module did not write
(not JSON, a field of the wrong type, a pid no process can have: checked strictly by
:meth:`RunInfo.parse`) is ignored with a debug line, and no error of a scan, expected or
not, stops the heartbeat (it is logged, and the next beat comes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass

from tierstore import _dist, settings
from tierstore.errors import ConfigError, ObjectNotFound, TierstoreError
from tierstore.format import layout
from tierstore.storage.backend import ObjectInfo
from tierstore.tiers.leases import store_time
from tierstore.tiers.tier import Tier

__all__ = ["RunInfo", "RunLock", "acquire", "DEFAULT_TTL"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 120.0  # a killed job is forgotten this long after its last heartbeat
MAX_TTL = 24 * 3600.0  # a lock claiming more (hostile or mistaken) is held to this
_LOCK_LIMIT = 1 << 16
_TTL_ENV = settings.RUN_LOCK_TTL.variable
_PID_MAX = (1 << 31) - 1  # pid_t; Linux's pid_max is at most 1 << 22


@dataclass(frozen=True)
class RunInfo:
    """What a run lock says about its job (the JSON body of each ``runs/<run>/<beat>.json``)."""

    run: str
    job: str  # the scheduler's job id when there is one, else the command
    host: str
    pid: int
    pid_space: str  # this boot of this machine and pid namespace: where the pid means something
    ttl: float

    def describe(self) -> str:
        return f"{self.job} (host {self.host}, pid {self.pid}, run {self.run[:8]})"

    def here(self) -> bool:
        """Whether its pid can be checked from this process: same machine and boot (not
        just the same host name) and same pid namespace (not another container)."""
        return bool(self.pid_space) and self.pid_space == _pid_space()

    @classmethod
    def parse(cls, data: bytes) -> RunInfo:
        """The lock ``data`` holds; :class:`ValueError` for anything but a lock this module
        writes. Strict, as any store input is (docs/design.md invariant 6): Python's json
        reads ``Infinity`` and ``NaN``, and a pid nothing can signal must never reach
        ``os.kill``."""
        try:
            body = json.loads(data)
        except RecursionError as err:
            raise ValueError("a run lock nested too deeply") from err
        if not isinstance(body, dict):
            raise ValueError("a run lock is a JSON object")
        text = {field: _string(body, field) for field in ("run", "job", "host")}
        pid, ttl = body.get("pid"), body.get("ttl")
        if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _PID_MAX):
            raise ValueError(f"pid is not a positive int: {pid!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
            raise ValueError(f"ttl is not a positive number of seconds: {ttl!r}")
        pid_space = body.get("pid_space", "")
        if not isinstance(pid_space, str):
            raise ValueError(f"pid_space is not a string: {pid_space!r}")
        return cls(text["run"], text["job"], text["host"], pid, pid_space, min(float(ttl), MAX_TTL))


class RunLock:
    """This job's run lock on one hot tier, kept fresh by a heartbeat thread until released."""

    def __init__(self, tier: Tier, info: RunInfo) -> None:
        self.tier, self.info = tier, info
        self.beat = 0
        self.warned: set[str] = set()  # run ids of the other jobs already named in a warning
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Released at interpreter exit too, so a job that never calls close() leaves no lock.
        self._finalizer = weakref.finalize(self, _delete, tier, info.run, self._stop, info.pid)

    @property
    def key(self) -> str:
        """The object of the current beat."""
        return layout.run_lock_key(self.info.run, self.beat)

    def start(self) -> None:
        """Check for other live jobs (warning about them) and start the heartbeat."""
        self._scan(starting=True)
        self._thread = threading.Thread(target=self._beat, name="tierstore-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lock (idempotent)."""
        self._finalizer()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.info.ttl / 4):
            try:
                previous = self.key
                self.beat += 1
                _publish(self.tier, self.key, self.info)
                if self._stop.is_set():  # released while this beat published: stay released
                    _forget(self.tier, [self.key])
                    return
                _forget(self.tier, [previous])
                self._scan(starting=False)
            except TierstoreError as err:
                log.debug("run lock heartbeat in %s failed: %s", self.tier.label, err)
            except Exception:  # a bug or a backend's stray error must not end the heartbeat
                log.warning("run lock heartbeat in %s failed; it goes on", self.tier.label, exc_info=True)

    def _scan(self, *, starting: bool) -> None:
        try:
            others = live_runs(self.tier, exclude=self.info.run)
        except TierstoreError as err:
            log.debug("could not list the run locks in %s: %s", self.tier.label, err)
            return
        except Exception:  # best effort (module docstring): never fails a start or a beat
            log.warning("could not check the run locks in %s", self.tier.label, exc_info=True)
            return
        for other in others:
            if other.run in self.warned:
                continue
            self.warned.add(other.run)
            if starting:
                log.warning(
                    "another job is saving into the hot directory %s: %s; this job %s starts "
                    "saving there too. Two jobs in one hot directory prune each other's "
                    "checkpoints, collide on step names and resume from each other's saves: "
                    "give each job its own directory (a job that was killed stops counting "
                    "%.0f s after its last heartbeat)",
                    self.tier.label,
                    other.describe(),
                    self.info.describe(),
                    other.ttl,
                )
            else:
                log.warning(
                    "job %s started saving into the hot directory %s, which this job %s is "
                    "saving into: they will prune each other's checkpoints and collide on "
                    "step names; give each job its own directory",
                    other.describe(),
                    self.tier.label,
                    self.info.describe(),
                )


def acquire(tier: Tier, *, ttl: float | None = None, job: str | None = None) -> RunLock | None:
    """Take this job's run lock on ``tier`` and warn about other live jobs there (module
    docstring). ``None`` when the tier refuses it (logged at debug level). ``ttl`` defaults
    to ``TIERSTORE_RUN_LOCK_TTL`` or :data:`DEFAULT_TTL`."""
    info = RunInfo(
        run=uuid.uuid4().hex,
        job=job or _job_label(),
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_space=_pid_space(),
        ttl=_ttl(ttl),
    )
    lock = RunLock(tier, info)
    try:
        _publish(tier, lock.key, info)  # before listing: of two jobs starting at once, one sees the other
        lock.start()
    except TierstoreError as err:
        lock.release()
        log.debug("no run lock in %s (another job there would go unnoticed): %s", tier.label, err)
        return None
    return lock


def live_runs(tier: Tier, *, exclude: str = "") -> list[RunInfo]:
    """The jobs with a live run lock in ``tier`` (but ``exclude``); dead ones' are deleted."""
    beats: dict[str, list[ObjectInfo]] = {}
    for item in tier.backend.list(layout.run_lock_prefix()):
        run = item.key.split("/")[1]
        if not layout.is_temporary(item.key) and run != exclude:
            beats.setdefault(run, []).append(item)
    if not beats:
        return []
    now = store_time(tier)  # None (logged): this machine's clock stands in
    live: list[RunInfo] = []
    for items in beats.values():
        newest = max(items, key=lambda i: (i.mtime or 0.0, i.key))
        try:
            other = RunInfo.parse(tier.backend.read_bytes(newest.key, limit=_LOCK_LIMIT))
        except ObjectNotFound:
            continue  # released, or a newer beat replaced it, meanwhile
        except (TierstoreError, ValueError) as err:  # one bad lock never hides the others
            log.debug("ignoring unreadable run lock %s in %s: %s", newest.key, tier.label, err)
            continue
        dead = other.here() and not _pid_exists(other.pid)
        if newest.mtime is not None:
            dead = dead or (time.time() if now is None else now) - newest.mtime >= other.ttl
        if dead:
            _forget(tier, [i.key for i in items])
        else:
            live.append(other)
    return live


def _string(body: dict[str, object], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or len(value) > 1024:
        raise ValueError(f"{field} is not a short string: {value!r:.80}")
    return value


def _publish(tier: Tier, key: str, info: RunInfo) -> None:
    tier.backend.publish(key, json.dumps(asdict(info)).encode())


def _delete(tier: Tier, run: str, stop: threading.Event, owner: int) -> None:
    stop.set()
    if os.getpid() != owner:  # a forked child exiting must not release its parent's lock
        return
    try:
        _forget(tier, [i.key for i in tier.backend.list(layout.run_lock_prefix(run))])
    except TierstoreError as err:
        log.debug("could not list run lock %s in %s: %s", run, tier.label, err)


def _forget(tier: Tier, keys: list[str]) -> None:
    try:
        tier.backend.delete_many(keys)
    except TierstoreError as err:
        log.debug("could not delete run lock %s in %s: %s", keys, tier.label, err)


def _ttl(value: float | None) -> float:
    """``value``, else ``TIERSTORE_RUN_LOCK_TTL``, else the default, checked."""
    given: str | float = value if value is not None else settings.read(settings.RUN_LOCK_TTL) or DEFAULT_TTL
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_TTL:  # nan fails too
        raise ConfigError(
            f"run lock ttl ({_TTL_ENV} or ttl=) must be a number of seconds in "
            f"(0, {MAX_TTL:.0f}], got {given!r}"
        )
    return seconds


def _job_label() -> str:
    """The scheduler's name of this job (the one a manifest records as its ``job``), else the
    command."""
    job = _dist.job_id()
    if job is not None:
        return job
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def _pid_space() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""  # no way to tell whose pid a number is: judge by heartbeat only


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
