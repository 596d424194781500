"""Two runs, one directory (issue 25): a named run resumes only its own checkpoints.

Run A saves steps 1..5 (real saves, a real ``CheckpointManager``); run B, pointed at the same
directory: with ``run="B"`` its ``load_latest`` returns ``None`` (never A's step) and one
warning names both runs, the directory and what happens; with ``RunOptions("B", strict=True)`` it is
a ``ConfigError`` naming both, before anything is saved; without a run name it resumes A's
step 5, as before. The same with a cold tier (hot + a local cold directory), node-local, and
as real separate processes. An explicit ``load(step=)``/``load(name=)`` of another run's
checkpoint works, with a warning naming both runs; the resume fallback past a damaged
checkpoint, and its quarantine, stay within the run; ``steps()`` agrees. A state that does
not fit a checkpoint is a ``ConfigError`` naming its checkpoint, step, run and world size, and
that the structure differs. Single process (DCP runs without a process group) but for the
separate-process test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cold_tiers import Cold, cold_of
from helpers import file_path, flip
from launch import run_job
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import (
    CheckpointManager,
    Retention,
    RunOptions,
    StagingOptions,
    Store,
    _dist,
    keep_last,
    list_checkpoints,
)
from tierstore.errors import ConfigError, MigrationFailed
from tierstore.format import layout
from tierstore.lifecycle.quarantine import list_quarantined
from tierstore.migration.migrator import MigrationOptions
from tierstore.options import ManagerOptions
from tierstore.retry import RetryPolicy
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Tier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=10,
    retry=RetryPolicy(attempts=2, initial=0.001, maximum=0.01),
)
OTHER_RUNS = "holds checkpoints of other runs"


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scheduler's id leaks in from the environment the tests run in."""
    for variable, _ in _dist._JOB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def state(step: int, width: int = 4) -> dict[str, Any]:
    return {"w": torch.full((width,), float(step)), "extra": {"step": step}}


def manager(hot: str, cold: str | None = None, **options: Any) -> CheckpointManager:
    """Synchronous saves, retention that prunes nothing here: only the runs are tested."""
    options.setdefault("retention", Retention(hot=keep_last(100), cold=keep_last(100), hot_min_free=None))
    return CheckpointManager(
        hot, cold, staging=StagingOptions(async_save=False), migration=FAST, save_every=1, **options
    )


def run_a(hot: str, cold: str | None = None, steps: range = range(1, 6), **options: Any) -> None:
    with manager(hot, cold, **options) as a:
        for step in steps:
            a.save(step, state(step))


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# -- two runs in one directory ----------------------------------------------------------------


@pytest.mark.parametrize(
    "a_run, a_job, a_named",
    [
        ("A", None, "run 'A'"),
        (None, "4242", "no named run (slurm job 4242)"),
        (None, None, "no recorded run"),
    ],
    ids=["named", "job-only", "unnamed"],
)
def test_a_named_run_never_resumes_another_runs_checkpoints(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    a_run: str | None,
    a_job: str | None,
    a_named: str,
) -> None:
    hot = str(tmp_path / "hot")
    if a_job is not None:
        monkeypatch.setenv("SLURM_JOB_ID", a_job)
    run_a(hot, run=a_run)
    monkeypatch.setenv("SLURM_JOB_ID", "5151")  # B is another job: a new id
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        b = manager(hot, run="B")
        [warning] = warnings_of(caplog, OTHER_RUNS)  # once, at start
        target = state(0)
        assert b.load_latest(target) is None  # never A's step
        assert torch.equal(target["w"], torch.zeros(4))  # nothing of A's loaded
        assert b.steps() == []
        b.save(6, state(6))
        assert b.load_latest(target) == 6 and target["extra"] == {"step": 6}
        b.close()
    assert warnings_of(caplog, OTHER_RUNS) == [warning]  # the load and the save said nothing more
    assert "run 'B'" in warning and a_named in warning and f"hot {hot}" in warning
    assert "step-0000000005 (step 5)" in warning and "5 checkpoints" in warning
    assert "resumes only checkpoints of run 'B'" in warning and "load(step=...)" in warning
    assert [(c.step, c.run) for c in list_checkpoints(hot)][-2:] == [(5, a_run), (6, "B")]


def test_a_strict_run_refuses_a_directory_holding_another_run_before_saving(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    before = sorted(p.name for p in Path(hot, "manifests").iterdir())
    with pytest.raises(ConfigError, match="RunOptions\\('B', strict=True\\)") as info:
        manager(hot, run=RunOptions("B", strict=True))
    message = str(info.value)
    assert "run 'A': 5 checkpoints, the newest step-0000000005 (step 5)" in message
    assert f"hot {hot}" in message and "nothing was saved" in message
    assert sorted(p.name for p in Path(hot, "manifests").iterdir()) == before
    assert not Path(hot, layout.RUN_DIR).exists() or not any(Path(hot, layout.RUN_DIR).rglob("*.json"))
    with manager(str(tmp_path / "own"), run=RunOptions("B", strict=True)) as own:  # its own directory
        assert own.load_latest(state(0)) is None
        own.save(1, state(1))
    with manager(str(tmp_path / "own"), run=RunOptions("B", strict=True)) as again:  # only its own there
        assert again.load_latest(state(0)) == 1


def test_without_a_run_name_the_newest_checkpoint_is_resumed_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    with caplog.at_level(logging.INFO, logger="tierstore"), manager(hot) as b:
        target = state(0)
        assert b.load_latest(target) == 5 and torch.equal(target["w"], torch.full((4,), 5.0))
        assert b.steps() == [1, 2, 3, 4, 5]
    assert not warnings_of(caplog, OTHER_RUNS)
    assert any(
        "loaded checkpoint step-0000000005 (step 5) of run 'A'" in r.getMessage() for r in caplog.records
    )


def test_asked_for_by_step_or_name_another_runs_checkpoint_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    with caplog.at_level(logging.WARNING, logger="tierstore"), manager(hot, run="B") as b:
        target = state(0)
        assert b.load(target, step=3) == 3 and target["extra"] == {"step": 3}
        assert b.load(target, name=layout.default_name(4)) == 4 and target["extra"] == {"step": 4}
        loaded = warnings_of(caplog, "into this manager's run 'B'")
        assert len(loaded) == 2 and all("of run 'A'" in w for w in loaded)
        assert "step-0000000003 (step 3)" in loaded[0] and "step-0000000004 (step 4)" in loaded[1]
        assert b.load_latest(state(0)) is None  # asking once changes nothing


def test_each_run_resumes_its_own_newest_among_the_others(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A", steps=range(1, 4))
    run_a(hot, run="B", steps=range(4, 8))
    run_a(hot, steps=range(8, 10))  # no run named: passed over by both
    for run, newest, steps in (("A", 3, [1, 2, 3]), ("B", 7, [4, 5, 6, 7]), (None, 9, list(range(1, 10)))):
        with manager(hot, run=run) as again:
            target = state(0)
            assert again.load_latest(target) == newest and target["extra"] == {"step": newest}, run
            assert again.steps() == steps
    with manager(hot, run="B") as b:  # of a step, its own is preferred, another's still loads
        assert b.load(state(0), step=2) == 2


def test_the_fallback_past_a_damaged_checkpoint_stays_within_the_run(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A", steps=range(1, 4))
    run_a(hot, run="B", steps=range(4, 5))
    newest_a = Tier("hot", hot).find_manifest(layout.default_name(3))
    assert newest_a is not None
    flip(file_path(hot, newest_a))
    with manager(hot, run="A") as a:
        target = state(0)
        assert a.load_latest(target) == 2 and target["extra"] == {"step": 2}  # not B's 4
        assert a.health().quarantined == (layout.default_name(3),)
    assert [q.name for q in list_quarantined(hot)] == [layout.default_name(3)]
    assert [(c.step, c.run) for c in list_checkpoints(hot)] == [(1, "A"), (2, "A"), (4, "B")]


def test_a_damaged_checkpoint_of_another_run_is_never_touched(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A", steps=range(1, 3))
    run_a(hot, run="B", steps=range(3, 4))
    other = Tier("hot", hot).find_manifest(layout.default_name(3))
    assert other is not None
    flip(file_path(hot, other))
    with manager(hot, run="A") as a:
        assert a.load_latest(state(0)) == 2
        assert a.health().quarantined == ()
    assert list_quarantined(hot) == []


# -- with a cold tier, node-local, and a cold tier that is down ----------------------------------


def test_two_runs_with_a_cold_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    run_a(hot, cold, run="A")  # close() delivers every checkpoint to the cold tier
    assert [c.tiers for c in list_checkpoints(Store(hot, cold))] == [("hot", "cold")] * 5
    with caplog.at_level(logging.WARNING, logger="tierstore"), manager(hot, cold, run="B") as b:
        assert b.load_latest(state(0)) is None
    [warning] = warnings_of(caplog, OTHER_RUNS)
    assert "run 'A'" in warning and "run 'B'" in warning
    with manager(hot, cold) as unnamed:
        assert unnamed.load_latest(state(0)) == 5


def test_a_named_runs_retention_never_prunes_another_runs_checkpoints(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    run_a(hot, cold, run="A")  # steps 1-5, all kept
    tight = Retention(hot=keep_last(1), cold=keep_last(2))
    run_a(hot, cold, steps=range(11, 15), run="B", retention=tight)
    # B's policies counted B's checkpoints alone; A's five are all still in both tiers.
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 3, 4, 5, 14]
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [1, 2, 3, 4, 5, 13, 14]
    # An unnamed run is every run's, as before: its retention counts them all.
    run_a(hot, cold, steps=range(21, 22), retention=Retention(hot=keep_last(1), cold=keep_last(100)))
    assert [c.step for c in list_checkpoints(hot)] == [21]


class FullDisk(LocalBackend):
    """A local hot tier that reports 1 GiB free: below any watermark of more, every save
    meets disk pressure."""

    scheme = "full"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url.replace("full://", "file://", 1), **options)

    def free_bytes(self) -> int | None:
        return 1 << 30


def test_under_disk_pressure_a_named_run_frees_only_its_own_checkpoints(
    tmp_path: Path, registered_backend: Any
) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A", steps=range(1, 3))
    registered_backend("full", FullDisk)
    pressed = Retention(hot=keep_last(100), hot_min_free=1 << 40)
    run_a(f"full://{hot}", steps=range(11, 14), run="B", retention=pressed)
    # Before each save the manager freed space beyond policy, down to the newest: B's older
    # checkpoint went (11, before the save of 13), A's stayed.
    assert [c.step for c in list_checkpoints(hot)] == [1, 2, 12, 13]


def test_another_runs_checkpoints_only_the_cold_tier_holds_are_named_by_the_first_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cold = str(tmp_path / "cold")
    run_a(str(tmp_path / "hot-a"), cold, run="A")
    fresh = str(tmp_path / "hot-b")  # a new hot directory, the old cold prefix
    with caplog.at_level(logging.WARNING, logger="tierstore"), manager(fresh, cold, run="B") as b:
        assert not warnings_of(caplog, OTHER_RUNS)  # the start sends the cold tier nothing
        assert b.load_latest(state(0)) is None
        [warning] = warnings_of(caplog, OTHER_RUNS)
        assert "run 'A'" in warning and f"cold {cold}" in warning
        assert b.load_latest(state(0)) is None
        assert len(warnings_of(caplog, OTHER_RUNS)) == 1
    strict = manager(fresh, cold, run=RunOptions("B", strict=True))
    with pytest.raises(ConfigError, match="run 'A'"):
        strict.load_latest(state(0))
    strict.close()


def test_two_node_local_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hot, cold = str(tmp_path / "nvme"), str(tmp_path / "cold")
    local = Store(hot, cold, node_local=True)
    run_a(local, run="A")
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [1, 2, 3, 4, 5]
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        with manager(local, run="B") as b:
            assert b.load_latest(state(0)) is None  # listed from the cold tier: the same rule
            assert b.steps() == []
        with manager(local) as unnamed:
            assert unnamed.load_latest(state(0)) == 5
        with pytest.raises(ConfigError, match="run 'A'"):
            manager(local, run=RunOptions("B", strict=True))
    [warning] = warnings_of(caplog, OTHER_RUNS)
    assert "run 'A'" in warning and "run 'B'" in warning


def test_a_cold_tier_that_is_down_does_not_fail_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cold tier's directory should be")
    with caplog.at_level(logging.WARNING, logger="tierstore.manager.runs"):
        b = manager(hot, str(blocker / "cold"), run="B", options=ManagerOptions(close_timeout=2))
    [warning] = warnings_of(caplog, OTHER_RUNS)
    assert "run 'A'" in warning
    with contextlib.suppress(MigrationFailed):  # A's checkpoints, found pending, cannot go
        b.close()


@pytest.fixture
def slow_s3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cold]:
    yield from cold_of(request, "s3-slow", tmp_path)


def test_a_stalled_cold_tier_does_not_delay_the_start(
    slow_s3: Cold, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    slow_s3.down("stall")  # every request to the cold tier hangs
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tierstore.manager.runs"):
        b = CheckpointManager(
            Store(hot, slow_s3.url, cold_options=slow_s3.options),
            run=RunOptions("B"),
            options=ManagerOptions(close_timeout=1),
            migration=FAST,
        )
    assert time.monotonic() - started < 5
    [warning] = warnings_of(caplog, OTHER_RUNS)
    assert "run 'A'" in warning
    slow_s3.up()
    with contextlib.suppress(MigrationFailed):  # A's checkpoints, found pending, had no time
        b.close()


# -- a state that does not fit ---------------------------------------------------------------


def test_a_structure_mismatch_names_the_checkpoint_its_step_run_and_world_size(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    run_a(hot, run="A")
    with manager(hot) as unnamed:
        with pytest.raises(ConfigError) as info:
            unnamed.load_latest(state(0, width=8))
    message = str(info.value)
    assert "the state does not match checkpoint step-0000000005 (step 5, run 'A', saved by 1 rank)" in message
    assert "Size mismatch" in message and "for w" in message  # DCP's own words
    assert "Its structure differs from the state's (fingerprint sha256:" in message
    assert "name its run (CheckpointManager(run=...))" in message
    assert info.value.checkpoint == layout.default_name(5)
    assert isinstance(info.value.__cause__, CheckpointException)  # the original, chained
    with manager(hot, run="B") as b:
        with pytest.raises(ConfigError, match="Missing key in checkpoint state_dict: lr") as info:
            b.load({**state(0), "lr": torch.zeros(1)}, step=4)
    assert "(step 4, run 'A', saved by 1 rank)" in str(info.value)
    assert "This manager is run 'B'; the checkpoint was asked for by name or step" in str(info.value)


# -- real separate processes ------------------------------------------------------------------

JOB = textwrap.dedent("""
    import json, logging, sys, warnings
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    import torch
    from tierstore import CheckpointManager, Retention, RunOptions, StagingOptions, keep_last
    from tierstore.errors import ConfigError, MigrationFailed
    hot, cold, role = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    run = {"A": None, "B": "B", "strict": RunOptions("B", strict=True), "unnamed": None}[role]
    try:
        manager = CheckpointManager(
            hot, cold, run=run, save_every=1, staging=StagingOptions(async_save=False),
            retention=Retention(hot=keep_last(10), cold=keep_last(10)),
        )
    except ConfigError as err:
        print(json.dumps({"error": str(err)}))
        sys.exit(3)
    if role == "A":
        for step in range(1, 6):
            manager.save(step, {"w": torch.full((4,), float(step))})
    target = {"w": torch.zeros(4)}
    step = None if role == "A" else manager.load_latest(target)
    manager.close()
    print(json.dumps({"step": step, "w": target["w"].tolist()}))
""")


def process(tmp_path: Path, hot: str, cold: str | None, role: str, job: str) -> tuple[int, Any, str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in _dist._JOB_VARIABLES}}
    proc = subprocess.run(
        [sys.executable, str(script), hot, cold or "", role],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "SLURM_JOB_ID": job},
        cwd=Path(__file__).parents[2],
    )
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("with_cold", [False, True], ids=["hot", "hot+cold"])
def test_two_runs_as_separate_processes(tmp_path: Path, with_cold: bool) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold") if with_cold else None
    code, out, err = process(tmp_path, hot, cold, "A", "101")  # A names no run: the case
    assert code == 0, err
    code, out, err = process(tmp_path, hot, cold, "B", "202")
    assert code == 0 and out == {"step": None, "w": [0.0] * 4}, err  # never A's weights
    [warning] = [line for line in err.splitlines() if OTHER_RUNS in line]
    assert warning.startswith("WARNING") and "run 'B'" in warning
    assert "no named run (slurm job 101): 5 checkpoints, the newest step-0000000005" in warning
    code, out, err = process(tmp_path, hot, cold, "strict", "303")
    assert code == 3 and "run 'B'" in out["error"] and "slurm job 101" in out["error"], err
    code, out, err = process(tmp_path, hot, cold, "unnamed", "404")
    assert code == 0 and out == {"step": 5, "w": [5.0] * 4}, err  # as before: the newest
    assert OTHER_RUNS not in err


@pytest.mark.dist
def test_two_runs_on_two_ranks_agree_and_strict_fails_on_every_rank(tmp_path: Path) -> None:
    hot, out = str(tmp_path / "hot"), tmp_path / "out"
    out.mkdir()
    job = run_job({"op": "manager_runs", "hot": hot, "out": str(out)}, 2)
    assert job.ok, job.describe()
    for rank in (0, 1):
        result = json.loads((out / f"runs-rank{rank}.json").read_text())
        assert result["named"] is None and (result["unnamed"], result["extra_step"]) == (3, 3), (rank, result)
        assert "run 'B'" in result["strict"] and "no recorded run: 3 checkpoints" in result["strict"], rank
    warned = [line for line in job.ranks[0].output.splitlines() if OTHER_RUNS in line]
    assert len(warned) == 1 and not any(OTHER_RUNS in line for line in job.ranks[1].output.splitlines())
