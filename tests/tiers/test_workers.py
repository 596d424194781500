"""This process's migrators (tierstore.migration.workers): one per tier pair and config, none in a forked
child, drained on request; the old import path still works, with a warning."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import save

from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.migration.workers import active_migrators, drain, migrator_for
from tierstore.tiers.tier import Tier


def test_one_migrator_per_pair_of_tiers_and_config(tmp_path: Path) -> None:
    hot, cold, other = (str(tmp_path / n) for n in ("hot", "cold", "other"))
    first = migrator_for(Tier("hot", hot), Tier("cold", cold), MigrationOptions(concurrency=3))
    assert migrator_for(Tier("hot", hot), Tier("cold", cold), MigrationOptions(concurrency=3)) is first
    assert migrator_for(Tier("hot", hot), Tier("cold", cold)).config == MigrationOptions()  # its own
    assert first.config.concurrency == 3
    elsewhere = migrator_for(Tier("hot", hot), Tier("cold", other))
    assert elsewhere is not first
    assert {id(first), id(elsewhere)} <= {id(m) for m in active_migrators()}


def test_a_forked_child_starts_with_no_migrators(tmp_path: Path) -> None:
    migrator_for(Tier("hot", str(tmp_path / "hot")), Tier("cold", str(tmp_path / "cold")))
    assert active_migrators()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        os._exit(0 if active_migrators() == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_drain_waits_for_the_saves_of_this_process(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    writer = save(hot, 1, cold, migration=MigrationOptions(chunk_size=4096, poll_interval=0.01))
    assert drain(60)
    [status] = writer.migrator.status()
    assert status.state is MigrationState.COMMITTED and not writer.migrator.pending()
