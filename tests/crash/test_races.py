"""Races between real processes: two writers on one step, and retention racing a save, a
migration and a load. Fault points armed to sleep hold each operation inside its window."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import model
import torch.distributed.checkpoint as dcp
from stats import STATS

from tierstore import TieredWriter, faults, layout, list_checkpoints
from tierstore.gc import collect_garbage
from tierstore.pending import migrate_pending, migration_status
from tierstore.prune import prune
from tierstore.retention import keep_last

HOLD = {"TIERSTORE_FAULT_SLEEP": "1.5"}


def save(hot: str, step: int, cold: str | None = None) -> None:
    dcp.save(model.state_for(step), storage_writer=TieredWriter(hot, cold, step=step, migration=model.FAST))


def background(fn, *, hold: str) -> int:
    """Fork ``fn`` with fault point ``hold`` armed to sleep; return the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        code = 0
        try:
            logging.disable(logging.CRITICAL)
            os.environ.update(HOLD)
            faults.disarm()
            faults.arm(hold, "sleep")
            fn()
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def wait(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_two_writers_on_one_step_commit_exactly_once(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")

    def writer(seed: int) -> None:
        dcp.save(model.state_for(seed), storage_writer=TieredWriter(hot, step=7))

    # Both pass the "not yet committed" check, then sleep after writing, then both publish.
    pids = [background(lambda s=seed: writer(s), hold="writer.after_file_write") for seed in (100, 200)]
    codes = [wait(pid) for pid in pids]
    STATS.faults += 1
    assert sorted(codes) == [0, 1], codes  # one commit; the other got CheckpointExists
    assert [c.step for c in list_checkpoints(hot)] == [7]
    target, _ = model.load(hot, None)
    winner = (100, 200)[codes.index(0)]
    assert all(model.torch.equal(target[k], model.state_for(winner)[k]) for k in model.SHAPES)
    assert len(os.listdir(Path(hot, layout.checkpoint_prefix(layout.default_name(7))))) == 2


def test_prune_racing_a_load_never_deletes_its_files(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)

    def load_step_1() -> None:
        target, _ = model.load(hot, None, layout.default_name(1), lease=True)
        assert model.matches(target, 1)

    pid = background(load_step_1, hold="reader.before_file")  # holds between files
    save(hot, 2)
    save(hot, 3)
    [report] = prune(hot, hot_policy=keep_last(1))  # step 1 goes while it is being read
    STATS.faults += 1
    assert layout.default_name(1) in report.deferred
    assert wait(pid) == 0  # the load finished, bit-exact
    assert [c.step for c in list_checkpoints(hot)] == [3]
    collect_garbage(hot, grace=0, dry_run=False)  # the lease is gone: now the data goes
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(1))).exists()


def test_prune_racing_a_migration_keeps_the_pending_checkpoint(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1)
    save(hot, 2)

    def migrate() -> None:
        migrate_pending(hot, cold, config=model.FAST)

    pid = background(migrate, hold="transfer.after_chunk")
    report = prune(hot, cold, hot_policy=keep_last(1), cold_policy=keep_last(5))[0]
    STATS.faults += 1
    assert report.deleted == ()  # step 1 is still pending in cold: protected
    assert wait(pid) == 0
    assert {s.state.value for s in migration_status(hot, cold)} == {"committed"}
    for step in (1, 2):
        target, _ = model.load(None, cold, layout.default_name(step))
        assert model.matches(target, step)


def test_prune_and_gc_racing_a_save(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)
    pid = background(lambda: save(hot, 2), hold="writer.before_manifest_publish")
    prune(hot, hot_policy=keep_last(1))
    collect_garbage(hot, dry_run=False)  # default grace: the young attempt is not garbage
    STATS.faults += 1
    assert wait(pid) == 0
    assert [c.step for c in list_checkpoints(hot)] == [1, 2]
    for step in (1, 2):
        target, _ = model.load(hot, None, layout.default_name(step))
        assert model.matches(target, step)
