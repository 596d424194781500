"""Races between real processes: two writers on one step, and retention racing a save, a
migration and a load. Each race is forced, not hoped for: operation A blocks at a fault
point inside its window (gates.py), B runs to its end, then A is released."""

from __future__ import annotations

import os
from pathlib import Path

import forking
import model
import torch.distributed.checkpoint as dcp
from gates import Gate
from stats import STATS

from tierstore import Store, TieredWriter, list_checkpoints
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.status import migrate_pending, migration_status


def save(hot: str, step: int, cold: str | None = None) -> None:
    dcp.save(model.state_for(step), storage_writer=TieredWriter(hot, cold, step=step, migration=model.FAST))


def held(gate: Gate, point: str, fn) -> forking.Job:  # type: ignore[no-untyped-def]
    """Fork ``fn``, and return once it is blocked at ``point``."""
    job = forking.start(lambda rank: fn(), block=point, env=gate.env)
    assert gate.wait_reached(point, pid=job.pids[0]), f"the operation never reached {point}"
    return job


def test_two_writers_on_one_step_commit_exactly_once(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")

    def writer(seed: int) -> None:
        dcp.save(model.state_for(seed), storage_writer=TieredWriter(hot, step=7))

    # Both pass the "not yet committed" check and write their files; A publishes first.
    gate_a, gate_b = Gate(tmp_path / "gate-a"), Gate(tmp_path / "gate-b")
    a = held(gate_a, "writer.after_file_write", lambda: writer(100))
    b = held(gate_b, "writer.after_file_write", lambda: writer(200))
    gate_a.release("writer.after_file_write")
    first = a.wait()
    gate_b.release("writer.after_file_write")
    second = b.wait()
    STATS.faults += 1
    assert first.ok, first.errors
    assert second.error_types == ["CheckpointExists"], second.errors  # one commit, A's
    assert [c.step for c in list_checkpoints(hot)] == [7]
    target, _ = model.load(hot, None)
    assert all(model.torch.equal(target[k], model.state_for(100)[k]) for k in model.SHAPES)
    assert len(os.listdir(Path(hot, layout.checkpoint_prefix(layout.default_name(7))))) == 2


def test_prune_racing_a_load_never_deletes_its_files(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)

    def load_step_1() -> bool:
        target, _ = model.load(hot, None, layout.default_name(1), lease=True)
        return model.matches(target, 1)

    gate = Gate(tmp_path / "gate")
    load = held(gate, "reader.before_file", load_step_1)  # leased, no file read yet
    save(hot, 2)
    save(hot, 3)
    [report] = prune(hot, hot_policy=keep_last(1))  # step 1 goes while it is being read
    STATS.faults += 1
    assert layout.default_name(1) in report.deferred
    gate.release("reader.before_file")
    outcome = load.wait()
    assert outcome.ok and outcome.results == [True], outcome.errors  # finished, bit-exact
    assert [c.step for c in list_checkpoints(hot)] == [3]
    collect_garbage(hot, grace=0, dry_run=False)  # the lease is gone: now the data goes
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(1))).exists()


def test_prune_racing_a_migration_keeps_the_pending_checkpoint(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    save(hot, 1)
    save(hot, 2)
    gate = Gate(tmp_path / "gate")
    migration = held(
        gate,
        "transfer.after_chunk",  # step 1's first file half copied
        lambda: migrate_pending(Store.of(hot, cold), config=model.FAST),
    )
    report = prune(Store.of(hot, cold), hot_policy=keep_last(1), cold_policy=keep_last(5))[0]
    STATS.faults += 1
    assert report.deleted == ()  # step 1 is still pending in cold: protected
    gate.release("transfer.after_chunk")
    outcome = migration.wait()
    assert outcome.ok, outcome.errors
    assert {s.state.value for s in migration_status(Store.of(hot, cold))} == {"committed"}
    for step in (1, 2):
        target, _ = model.load(None, cold, layout.default_name(step))
        assert model.matches(target, step)


def test_prune_and_gc_racing_a_save(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)
    gate = Gate(tmp_path / "gate")
    saving = held(gate, "writer.before_manifest_publish", lambda: save(hot, 2))  # files written
    prune(hot, hot_policy=keep_last(1))
    collect_garbage(hot, dry_run=False)  # default grace: the young attempt is not garbage
    STATS.faults += 1
    gate.release("writer.before_manifest_publish")
    outcome = saving.wait()
    assert outcome.ok, outcome.errors
    assert [c.step for c in list_checkpoints(hot)] == [1, 2]
    for step in (1, 2):
        target, _ = model.load(hot, None, layout.default_name(step))
        assert model.matches(target, step)
