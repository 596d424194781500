"""The end of a run: its checkpoints delivered to the cold tier, boundedly, or each one that was
not named (docs/design.md invariant 22). :class:`Delivery` is the part of a manager that
``wait()`` and ``close()`` (:mod:`tierstore.manager.core`) deliver through."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tierstore.errors import MigrationFailed
from tierstore.migration.delivery import (
    PROBE_WAIT,
    await_delivery,
    deliver,
    describe,
    undelivered,
)
from tierstore.migration.migrator import Migrator
from tierstore.tiers.tier import Store

__all__ = ["Delivery", "left"]

log = logging.getLogger(__name__)


class Delivery:
    """This process's migrations to ``store``'s cold tier (by ``migrators()``), waited for
    against a deadline and spent trying (invariant 26), and what they left undelivered.
    ``catalog``: whether this process looks the undelivered ones up in the cold catalog (every
    process but the non-coordinators of node-local hot tiers). ``copies``: the manager's copies
    on other nodes (:class:`~tierstore.manager.copies.PeerCopies`), which its errors count."""

    def __init__(
        self, store: Store, migrators: Callable[[], list[Migrator]], *, catalog: bool, copies: Any = None
    ) -> None:
        self.store, self._migrators, self._catalog, self._copies = store, migrators, catalog, copies
        self.cold_down = False  # close() found the cold tier unreachable: nothing to look up
        self._reported: set[str] = set()  # migration failures wait() raised already

    def deliver(self, deadline: float | Callable[[], float] | None, *, in_grace: bool) -> str | None:
        """This process's migrations, until ``deadline``: waited for once without one, else
        tried again while the cold tier answers (:func:`~tierstore.migration.delivery.deliver`);
        a cold tier that answers nothing for ``PROBE_WAIT`` seconds in a row is given up on
        (``in_grace`` of a preemption notice, not before the deadline): returns why."""
        cold, migrators = self.store.cold, self._migrators()
        if cold is None or not migrators or self.cold_down:
            return None
        if deadline is None:
            await_delivery(migrators, None)
            return None
        why = deliver(migrators, cold, deadline, give_up_after=None if in_grace else PROBE_WAIT)
        if why is not None:
            log.error(
                "the cold tier %s is unreachable (%s): its migrations are not waited for any longer",
                cold.label,
                why,
            )
        return why

    def undelivered(self, deadline: float | None, *, in_grace: bool) -> dict[str, str]:
        """This process's checkpoints not in the cold tier, and why, each looked up there
        boundedly: even when the deadline passed, and not at all in a cold tier found
        unreachable (``in_grace`` of a notice, the grace period bounds the lookups too)."""
        cold = self.store.cold
        if cold is None:
            return {}
        floor = 0.0 if in_grace else 5.0
        lookup = 0.0 if self.cold_down else 30.0 if deadline is None else left(deadline, floor=floor)
        return undelivered(self._migrators(), cold, timeout=lookup, catalog=self._catalog)

    def failed_once(self, deadline: float | None, *, in_grace: bool) -> MigrationFailed | None:
        """The checkpoints whose migration failed and that are still pending, not raised
        before (``wait()``'s error), each once."""
        failed = {
            name: why
            for name, why in self.undelivered(deadline, in_grace=in_grace).items()
            if name not in self._reported and not why.startswith("still ")
        }
        self._reported.update(failed)
        return self.failed(failed) if failed else None

    def stop(self, names: set[str]) -> None:
        """Stop the migrations of ``names``: nothing of them runs after this returns."""
        for migrator in self._migrators():
            migrator.stop(names)

    def failed(self, failures: dict[str, str]) -> MigrationFailed:
        """The error naming ``failures``; with copies on other nodes, how many verified copies
        protect each meanwhile."""
        assert self.store.hot is not None and self.store.cold is not None
        message = describe(failures, self.store.hot, self.store.cold)
        copies = self._copies
        if copies is not None and copies.on:
            message += (
                ". Meanwhile each is protected by copies on other nodes, as verified: "
                + copies.describe_pending(list(failures))
            )
        return MigrationFailed(message, checkpoints=tuple(failures), errors=failures)


def left(deadline: float | None, *, floor: float = 0.0) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), at least ``floor``."""
    return None if deadline is None else max(floor, deadline - time.monotonic())
