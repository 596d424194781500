"""Cadence from the failure rate: Young/Daly intervals, their costs, and the time-based cadence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tierstore.errors import ConfigError
from tierstore.resume.cadence import TimeCadence, expected_waste, optimal_interval


def test_young_interval_is_sqrt_of_twice_stall_times_job_mtbf() -> None:
    plan = optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=15.0, method="young")
    assert plan.mtbf_job == pytest.approx(30 * 86400 / 64)
    assert plan.interval == pytest.approx(math.sqrt(2 * 15.0 * 40500))  # ~1102 s
    assert plan.lost_per_failure == pytest.approx((plan.interval + 15.0) / 2)
    assert plan.stall_overhead == pytest.approx(15.0 / plan.interval)


def test_daly_is_close_to_young_for_small_stalls_and_bounded_by_the_mtbf() -> None:
    young = optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=15.0, method="young")
    daly = optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=15.0)
    assert daly.interval == pytest.approx(young.interval, rel=0.02) and daly.interval < young.interval
    assert optimal_interval(nodes=1, mtbf_node=100.0, stall=500.0).interval == 100.0


def test_the_optimum_wastes_less_than_its_neighbours() -> None:
    best = optimal_interval(nodes=16, mtbf_node=7 * 86400, stall=30.0, restart=300.0, method="young")
    for factor in (0.5, 0.8, 1.25, 2.0):
        other = expected_waste(best.interval * factor, mtbf_job=best.mtbf_job, stall=30.0, restart=300.0)
        assert other.waste > best.waste


def test_more_nodes_or_cheaper_saves_mean_saving_more_often() -> None:
    base = optimal_interval(nodes=8, mtbf_node=86400.0, stall=10.0).interval
    assert optimal_interval(nodes=32, mtbf_node=86400.0, stall=10.0).interval < base
    assert optimal_interval(nodes=8, mtbf_node=86400.0, stall=1.0).interval < base


@pytest.mark.parametrize("kwargs", [{"nodes": 0}, {"stall": 0.0}, {"mtbf_node": -1.0}, {"method": "x"}])
def test_bad_inputs_are_refused(kwargs: dict[str, object]) -> None:
    args = {"nodes": 4, "mtbf_node": 1000.0, "stall": 1.0, **kwargs}
    with pytest.raises(ConfigError):
        optimal_interval(**args)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_cadence_saves_when_the_interval_has_elapsed() -> None:
    clock = Clock()
    cadence = TimeCadence(60.0, clock=clock, distributed=False)
    decisions = []
    for step in range(1, 11):
        clock.now += 25.0  # 25 s per step: due at 75 s, then 150 s, 225 s
        decisions.append(cadence(step))
    assert [s for s, d in zip(range(1, 11), decisions) if d] == [3, 6, 9]


def test_time_cadence_checks_only_every_n_steps() -> None:
    clock = Clock()
    cadence = TimeCadence(10.0, clock=clock, check_every=4, distributed=False)
    clock.now = 100.0
    assert [cadence(s) for s in (1, 2, 3, 4, 5)] == [False, False, False, True, False]


def test_from_failure_rate_and_update_from_a_measured_stall() -> None:
    clock = Clock()
    cadence = TimeCadence.from_failure_rate(
        nodes=64, mtbf_node=30 * 86400, stall=15.0, clock=clock, distributed=False
    )
    first = cadence.interval
    assert first == pytest.approx(optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=15.0).interval)
    assert cadence.update(stall={10: 0.2, 20: 0.4}.values()) < first  # async_save stalls are small
    with pytest.raises(ConfigError):
        TimeCadence(5.0).update(stall=1.0)


def test_manager_takes_a_time_cadence(tmp_path: object) -> None:
    from tierstore import CheckpointManager

    clock = Clock()
    manager = CheckpointManager(str(tmp_path), save_every=TimeCadence(30.0, clock=clock, distributed=False))
    clock.now = 31.0
    assert manager.should_save(1) and not manager.should_save(2)
    manager.close()


@pytest.mark.dist
def test_ranks_with_different_clocks_decide_alike(tmp_path: Path) -> None:
    from launch import run_job

    job = run_job(
        {"op": "cadence", "out": str(tmp_path)}, 2, script=Path(__file__).parents[1] / "resume_job.py"
    )
    assert job.ok, job.describe()
    decisions = [json.loads((tmp_path / f"cadence-{r}.json").read_text()) for r in (0, 1)]
    # Rank 0's clock is due at the first check, rank 1's only at the second: nobody saves alone.
    assert decisions[0] == decisions[1] == [False, True, False, True]
