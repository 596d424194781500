"""The training-shaped loop of the perf suite (benchmarks/jobs/perf_loop.py) and its part of the
report (benchmarks/report/loop.py): every rep recorded and shown, the spread and the floors
computed from the reps, not from a best-of alone."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks.infra.launch import run_module
from benchmarks.jobs import perf_loop
from benchmarks.report import loop

MiB = 1 << 20
SMOKE = Path(__file__).parent / "data" / "bench-smoke.json"


def _record(op: str, variant: str, rep: int, cpu: float, sys: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"op": op, "variant": variant, "rep": rep, "cpu": cpu, "sys": sys, "seconds": cpu, **extra}


def _loop(save: dict[str, list[float]], load: dict[str, list[float]]) -> list[dict[str, Any]]:
    records = []
    for op, sides in (("save", save), ("load", load)):
        for variant, cpus in sides.items():
            records += [_record(op, variant, -1, 9.9)]  # a warm-up rep, never in a figure
            records += [_record(op, variant, rep, cpu) for rep, cpu in enumerate(cpus)]
    return records


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the loop runs on tmpfs")
def test_the_loop_job_records_every_rep_of_every_side_and_cleans_up(tmp_path: Path) -> None:
    # In a process of its own, as the suite runs it: each of its timed operations starts
    # with a gc.collect(), which in a pytest worker's heap costs 40x the job itself.
    root = Path("/dev/shm") / f"tierstore-test-loop-{os.getpid()}"
    records = run_module("perf_loop", {"bytes": 4 * MiB, "reps": 2, "root": str(root)}, tmp_path / "job")
    assert not root.exists()
    seen = {(r["op"], r["variant"], r["rep"]) for r in records}
    warm = perf_loop.KEEP + 1
    for op, names in (("save", perf_loop.SAVES), ("load", perf_loop.LOADS)):
        for name in names:
            assert {(op, name, rep) for rep in range(-warm, 2)} <= seen
    assert {r["variant"] for r in records if r["op"] == "pages"} == {"reused", "new"}
    for r in records:
        assert r["seconds"] > 0 and r["cpu"] == pytest.approx(r["user"] + r["sys"]) and r["bytes"] > 3 * MiB


def test_the_floor_save_overwrites_in_place_and_holds_exactly_the_state(tmp_path: Path) -> None:
    import torch

    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10, dtype=torch.float64)}
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * 100_000)  # an older, longer checkpoint in the slot
    inode = path.stat().st_ino
    perf_loop.floor_save(state, path)
    assert path.stat().st_ino == inode and path.stat().st_size == 4000 + 80
    into = {"a": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.float64)}
    perf_loop.floor_load(into, path)
    assert all(torch.equal(into[k], state[k]) for k in state)


def test_spread_and_the_worst_rep_against_the_baseline_come_from_every_rep() -> None:
    records = _loop(
        save={"fsw": [1.0, 1.0, 1.0, 1.0], "tiered": [0.5, 0.5, 2.0, 0.5], "floor": [0.4, 0.45, 0.4, 0.4]},
        load={"fsr": [1.0, 1.0, 1.0, 1.0], "tiered": [0.3, 0.31, 0.3, 0.3], "floor": [0.29, 0.3, 0.3, 0.3]},
    )
    found = {t.key: t for t in loop.loop_targets(records)}
    assert found["save_loop_spread"].value == pytest.approx(4.0) and found["save_loop_spread"].met is False
    assert found["save_loop_fsw"].value == pytest.approx(2.0) and found["save_loop_fsw"].met is False
    assert loop.worst_against(records, "save", "tiered", "fsw") == (pytest.approx(2.0), 2)
    assert (
        found["save_loop_floor"].value == pytest.approx(0.5 / 0.4) and found["save_loop_floor"].met is False
    )
    assert (
        found["load_loop_floor"].value == pytest.approx(0.3 / 0.29) and found["load_loop_floor"].met is True
    )
    assert found["load_loop_spread"].met is True and found["load_loop_fsr"].met is True


def test_the_parts_show_each_rep_the_warm_up_apart_and_every_target() -> None:
    records = _loop(
        save={"fsw": [1.0, 1.1], "tiered": [0.5, 1.5], "floor": [0.4, 0.4]},
        load={"fsr": [1.0, 1.0], "tiered": [0.3, 0.3], "floor": [0.3, 0.3]},
    )
    results = {"suites": {"perf": {"loop": {"bytes": 512 * MiB, "reps": 2, "records": records}}}}
    reps = loop.reps_part(results)
    assert "| -1 (warm-up) |" in reps and "| 0 |" in reps and "| 1 |" in reps
    assert "9.900" not in reps.split("| 0 |")[1]  # the warm-up is in no figure after its row
    targets = loop.targets_part(results)
    assert (
        "| save CPU spread over the loop, TieredWriter (worst rep / best rep) | 3.00x | <= 1.50x | **missed** |"
        in (targets)
    )
    assert loop.pages_part(results) == ""  # no page phase in this run
    for part in (loop.targets_part, loop.reps_part, loop.pages_part):
        assert part({"suites": {"perf": {"io": {}}}}) == ""


def test_the_smoke_results_fill_the_loop_parts_under_save() -> None:
    from benchmarks.report import render

    results = json.loads(SMOKE.read_text())
    reps = loop.reps_part(results)
    assert reps.startswith("| rep |") and "| 0 |" in reps and "| 1 |" in reps
    assert "| over the pages of a file, overwritten in place |" in loop.pages_part(results)
    order = list(render.PARTS)
    assert order.index("perf.save") < order.index("loop.targets") < order.index("load")


def test_the_null_reader_loads_no_data_but_runs_dcps_load(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from benchmarks.jobs.perf_io import NullReader

    state = {"a": torch.arange(6, dtype=torch.float32), "meta": {"step": 3}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    into = {"a": torch.zeros(6), "meta": {"step": -1}}
    dcp.load(into, storage_reader=NullReader(tmp_path), no_dist=True)
    assert torch.equal(into["a"], torch.zeros(6)) and into["meta"] == {"step": -1}  # nothing read
    with pytest.raises(CheckpointException, match="Missing key"):  # DCP's own planning still runs
        dcp.load({"b": torch.zeros(6)}, storage_reader=NullReader(tmp_path), no_dist=True)
