"""A resume reproduces the run: 2-rank FSDP2 jobs (gloo, CPU) SIGKILLed mid-save and mid-step.

The uninterrupted run's per-step losses are the reference. A run killed in the middle of a
save, and one killed in the middle of a step, each resume from the newest committed checkpoint
and must reproduce every later loss bit for bit. Leaving the RNG state or the data position out
of the checkpoint must change the curve: that is what proves the test can see them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import run_job

from tierstore import list_checkpoints
from tierstore.testing.faults import armed_env

pytestmark = pytest.mark.dist

JOB = Path(__file__).parents[1] / "resume_job.py"
STEPS, SAVE_EVERY = 14, 4  # 10 steps per epoch: the resumed runs cross an epoch boundary


def losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


def resumed_from(path: Path) -> int:
    return int(json.loads(path.read_text().splitlines()[0])["resumed_from"])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """The uninterrupted run: its per-step losses and its store (checkpoints at 4, 8, 12)."""
    out = tmp_path_factory.mktemp("reference")
    spec = {
        "op": "train",
        "runs": [{"tag": "full", "hot": str(out / "hot"), "exclude": []}],
        "steps": STEPS,
        "save_every": SAVE_EVERY,
        "out": str(out),
    }
    job = run_job(spec, 2, script=JOB)
    assert job.ok, job.describe()
    curve = losses(out / "losses-train.jsonl")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve, out / "hot"


@pytest.fixture
def reference(reference_run: tuple[dict[int, float], Path]) -> dict[int, float]:
    return reference_run[0]


def kill_and_resume(
    out: Path,
    runs: list[dict[str, object]],
    *,
    kill_at: dict[str, int] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> None:
    spec = {
        "op": "train",
        "runs": runs,
        "steps": STEPS,
        "save_every": SAVE_EVERY,
        "out": str(out),
        "kill_at": kill_at,
    }
    job = run_job(spec, 2, script=JOB, rank_env=rank_env)
    assert not job.ok and job.ranks[1].returncode == -9, job.describe()  # rank 1 was SIGKILLed
    job = run_job({**spec, "op": "resume", "kill_at": None}, 2, script=JOB)
    assert job.ok, job.describe()


def test_sigkill_mid_save_then_resume_reproduces_every_loss(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    hot = tmp_path / "hot"
    # Rank 1 dies in its background flush of the second checkpoint (step 8), after writing its
    # shard: step 8 never commits, so the resume must come from step 4.
    kill_and_resume(
        tmp_path,
        [{"tag": "full", "hot": str(hot), "exclude": []}],
        rank_env={1: armed_env("writer.after_file_write@2=kill")},
    )
    before = losses(tmp_path / "losses-train.jsonl")
    assert before and all(reference[s] == v for s, v in before.items())
    resumed = tmp_path / "losses-resume-full.jsonl"
    assert resumed_from(resumed) == 4
    after = losses(resumed)
    assert sorted(after) == list(range(5, STEPS + 1))
    assert after == {s: reference[s] for s in after}, "resumed losses differ from the uninterrupted run"
    assert [c.step for c in list_checkpoints(str(hot))][-1] == 12  # the resumed run saves on


def test_sigkill_mid_step_resumes_exactly_and_only_with_rng_and_data(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    runs = [
        {"tag": tag, "hot": str(tmp_path / tag), "exclude": exclude}
        for tag, exclude in (("full", []), ("no-rng", ["rng"]), ("no-data", ["data"]))
    ]
    kill_and_resume(tmp_path, runs, kill_at={"step": 7, "rank": 1})
    before = losses(tmp_path / "losses-train.jsonl")
    assert sorted(before) == list(range(1, 7))  # step 7 never finished
    assert all(reference[s] == v for s, v in before.items())
    curves = {}
    for run in runs:
        path = tmp_path / f"losses-resume-{run['tag']}.jsonl"
        assert resumed_from(path) == 4, run["tag"]
        curves[run["tag"]] = losses(path)
        assert sorted(curves[run["tag"]]) == list(range(5, STEPS + 1))
    expected = {s: reference[s] for s in range(5, STEPS + 1)}
    assert curves["full"] == expected, "the full resume must be bit-exact"
    for tag in ("no-rng", "no-data"):  # left out, the run visibly diverges from the first step on
        assert curves[tag] != expected, f"{tag}: leaving it out should change the curve"
        assert curves[tag][5] != expected[5], tag


def test_resume_on_three_ranks_continues_at_the_global_data_position(
    tmp_path: Path, reference_run: tuple[dict[int, float], Path]
) -> None:
    # The 2-rank reference saved step 12; 3 ranks resume it (ResumePlanner: rank 2 has no RNG
    # entry of its own) and train steps 13-14, saving nothing (13 and 14 are off the cadence).
    spec = {
        "op": "resume",
        "steps": STEPS,
        "save_every": SAVE_EVERY,
        "out": str(tmp_path),
        "planner": "resume",
        "runs": [{"tag": "grown", "hot": str(reference_run[1]), "exclude": []}],
    }
    job = run_job(spec, 3, script=JOB)
    assert job.ok, job.describe()
    path = tmp_path / "losses-resume-grown.jsonl"
    assert resumed_from(path) == 12 and sorted(losses(path)) == [13, 14]
    state = json.loads((tmp_path / "data-grown.json").read_text())
    # Epoch 0 was 10 steps of 2 x 4 samples; in epoch 1, 2 steps of 2 x 4, then 2 of 3 x 4.
    assert state == {"epoch": 1, "position": 16 + 24, "world_size": 3}
