"""``CheckpointManager``: the training loop's one object for saving, resuming and retention.

::

    manager = CheckpointManager("/nvme/run1", "s3://bucket/run1", save_every=500,
                                retention=Retention(hot=keep_last(2), cold=keep_last(3) | keep_every(5000)))
    start = manager.load_latest(state) or 0      # Stateful objects in `state` are restored
    for step in range(start + 1, total + 1):
        train_step()
        manager.save(step, state)                # skipped unless the cadence wants it
    manager.close()                              # waits for the last flush and migrations

Saves run through ``dcp.async_save`` (THREAD by default) on a process group of the manager's
own, so its collectives never interleave with training's. ``save()`` returns once the state
is copied into staging buffers that are allocated on the first save and reused by every later
one (:mod:`tierstore.staging`); from then on training may change the state. The next save
waits only for the previous flush. After each commit the coordinator prunes in the
background, so slow object store deletes never stall a save. Nothing on the save path sends
a request to the cold tier: a cold tier that is slow, stalled, down or denying writes delays
no save.

Failures are loud: a save that fails (in the background, under ``async_save``) is raised as
:class:`~tierstore.errors.SaveFailed` by the next :meth:`CheckpointManager.save`, or by
:meth:`~CheckpointManager.wait` / :meth:`~CheckpointManager.close` if no save follows, once.
Migration and pruning never raise into training (``save``); :meth:`CheckpointManager.health`
reports them, every failure is logged, and :meth:`~CheckpointManager.wait` and
:meth:`~CheckpointManager.close` raise :class:`~tierstore.errors.MigrationFailed` for a
checkpoint that did not reach the cold tier.

The end of a run delivers its last checkpoints, or says loudly that it did not (docs/design.md
invariant 22): ``close()`` waits for the pending migrations up to ``close_timeout`` seconds
in all (default 300; the deadline covers every wait of close, not each in turn), logging
what it waits for, then stops whatever is left (nothing of it runs after close returns) and
raises :class:`~tierstore.errors.MigrationFailed` naming each checkpoint that stays pending
in the hot tier. A manager with a cold tier resumes, in the background, the migrations it
finds pending: at start (a killed run's) and after each commit (those a cold outage failed).

A checkpoint a resume proved damaged (in every tier holding it) is quarantined
(:mod:`tierstore.lifecycle.quarantine`): un-published, its data kept, so the step it held is
saved again as a new attempt and retention counts only good checkpoints.
"""

from __future__ import annotations

from tierstore.manager.core import DEFAULT_CLOSE_TIMEOUT, CheckpointManager
from tierstore.manager.health import Health

__all__ = ["CheckpointManager", "Health", "DEFAULT_CLOSE_TIMEOUT"]
