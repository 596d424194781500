"""The migrator's breaker: a cold tier that is down is met once, then probed (docs/design.md
invariant 26).

A job that failed for a transient reason (retries exhausted: the cold tier down, stalled,
refusing) opens it. While it is open the jobs behind fail at once, sending nothing, instead of
each spending its own retries on a tier that is down; it lets one job through as a probe (one
listing, bounded by ``PROBE_WAIT``) ``first_probe`` seconds after it opened, then at doubling
intervals up to ``longest``. The cold tier answering (the probe, or any job that succeeds)
closes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierstore.errors import TransientStorageError
from tierstore.migration.jobs import JobFailed
from tierstore.migration.probe import PROBE_WAIT, unreachable
from tierstore.storage import faults
from tierstore.tiers.tier import Tier

__all__ = ["Breaker"]

log = logging.getLogger(__name__)


class Breaker:
    """The breaker of one migrator's cold tier (see the module docstring)."""

    def __init__(self, cold: Tier, *, clock: Callable[[], float], first_probe: float, longest: float) -> None:
        self._cold = cold
        self._clock = clock
        self._first_probe = first_probe
        self._longest = longest
        self._lock = threading.Lock()
        self._unreachable: tuple[float, str] | None = None  # (since, why): the breaker is open
        self._next_probe = 0.0  # when the open breaker lets the next job through as a probe
        self._probe_every = first_probe

    def check(self) -> None:
        """Return if a job may go ahead (closed, or this job is the probe and the tier
        answers); else raise the job's :class:`JobFailed`, "not attempted"."""
        with self._lock:
            unreachable_since = self._unreachable
            if unreachable_since is None:
                return
            since, why = unreachable_since
            now = self._clock()
            if now < self._next_probe:
                raise JobFailed(
                    None,
                    None,
                    TransientStorageError(
                        f"not attempted: the cold tier was unreachable {now - since:.0f}s ago ({why}); "
                        f"it is probed again in {self._next_probe - now:.0f}s, and the job is "
                        "tried again by the next commit, close() or `tierstore migrate`",
                        tier=self._cold.label,
                    ),
                )
            # This job is the probe: the ones behind it wait for the next.
            self._next_probe = now + self._probe_every
            self._probe_every = min(self._probe_every * 2, self._longest)
        faults.point("migrator.before_probe")
        down = unreachable(self._cold, PROBE_WAIT)
        if down is None:
            log.info("the cold tier %s answers again: migrating", self._cold.label)
            self.close()
            return
        raise JobFailed(
            None,
            None,
            TransientStorageError(
                f"not attempted: the cold tier is still unreachable ({down}); "
                "the job is tried again by the next commit, close() or `tierstore migrate`",
                tier=self._cold.label,
            ),
        )

    def open(self, why: str) -> None:
        """A job failed for a transient reason ``why``: open, unless open already."""
        with self._lock:
            if self._unreachable is None:
                now = self._clock()
                self._unreachable = (now, why)
                self._next_probe = now + self._first_probe
                self._probe_every = 2 * self._first_probe

    def close(self) -> None:
        """The cold tier answered: the next job is attempted."""
        with self._lock:
            self._unreachable = None
            self._probe_every = self._first_probe
