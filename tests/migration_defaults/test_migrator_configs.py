"""Background state is explicit (issue 36, item 4): a writer asking for a migration config
other than the one already running for its tiers gets a migrator of its own, with its
config, never a silently ignored one; a process that never migrates has no exit hook."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import save

from tierstore import list_checkpoints
from tierstore.migration.migrator import MigrationOptions, MigrationState
from tierstore.migration.workers import migrators_of


def test_a_writer_asking_another_config_gets_its_own_migrator_with_it(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    first = MigrationOptions(chunk_size=4096, poll_interval=0.01, commit_timeout=30)
    second = MigrationOptions(chunk_size=8192, poll_interval=0.01, commit_timeout=30, concurrency=1)
    one = save(hot, 1, cold, migration=first, migrated=True).migrator
    two = save(hot, 2, cold, migration=second, migrated=True).migrator
    again = save(hot, 3, cold, migration=first, migrated=True).migrator
    assert one is not None and two is not None
    assert one.config == first and two.config == second  # the second config is not ignored
    assert two is not one and again is one  # the same config, the same migrator
    # Each checkpoint went through the migrator of its writer's config, and reached the cold tier.
    assert {s.name for s in one.status()} == {"step-0000000001", "step-0000000003"}
    assert [(s.name, s.state) for s in two.status()] == [("step-0000000002", MigrationState.COMMITTED)]
    assert [c.step for c in list_checkpoints(cold)] == [1, 2, 3]
    assert {id(m) for m in migrators_of(one.hot, one.cold)} == {id(one), id(two)}


def test_no_exit_hook_until_the_first_migrator(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import threading
        from tierstore.migration import workers
        from tierstore.tiers.tier import Tier

        def hooked():
            return any(getattr(c, "func", None) is workers._drain_at_exit for c in threading._threading_atexits)

        assert not hooked(), "importing tierstore registered an exit hook"
        workers.migrator_for(Tier("hot", {str(tmp_path / "hot")!r}), Tier("cold", {str(tmp_path / "cold")!r}))
        assert hooked(), "the first migrator registered no exit hook"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
