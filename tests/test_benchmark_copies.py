"""The Copies on other nodes section of the benchmark report (benchmarks/jobs/copies.py and its
tables in benchmarks/report/copies.py), without a real run: the job's ranks merged into one
record per measurement (the slowest rank's time, every rank's bytes and CPU, a loop's saves
save by save, its first save left out), the raw gloo baseline between the very ranks
``Replicas(2)`` pairs, each side's best of reps with its spread, the targets judged on best
against best, the four parts written in the report and left alone by a run without the suite,
and the ranks started as 2 nodes of 2 (``LOCAL_WORLD_SIZE=2``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.infra.measure import MiB
from benchmarks.jobs import copies as job
from benchmarks.report import copies, render
from benchmarks.report.tables import DOC
from tierstore.redundancy.schemes import Replicas, Topology

PARTS = ["copies.targets", "copies.stall", "copies.throughput", "copies.restore"]


def _rows(text: str) -> list[list[str]]:
    table = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in table[1:]]


def _stall(variant: str, rep: int, stall: float, **more: Any) -> dict[str, Any]:
    base = {"stall_max": stall, "save_cpu": 0.06, "compute": 0.5, "loop": 12.0, "settled": 12.5, "cpu": 30.0}
    return {"phase": "stall", "medium": None, "variant": variant, "rep": rep, "stall": stall, **base, **more}


def _move(phase: str, medium: str, variant: str, rep: int, seconds: float, **more: Any) -> dict[str, Any]:
    record = {"received": 256 * MiB, "cpu": 0.5}
    return {
        "phase": phase,
        "medium": medium,
        "variant": variant,
        "rep": rep,
        "seconds": seconds,
        **record,
        **more,
    }


def suite() -> dict[str, Any]:
    records = [
        _stall("plain", 0, 0.040),
        _stall("plain", 1, 0.050),
        _stall("replicas", 0, 0.060, rounds=[[1.0, 256 * MiB], [2.0, 256 * MiB]], overlapped=1, saves=5),
        _stall("replicas", 1, 0.042, rounds=[[0.5, 256 * MiB]], saves=5),
    ]
    for medium, factor in (("disk", 2.0), ("tmpfs", 1.0)):
        records += [
            _move("copies", medium, "manager_round", -1, 0.0, transfer=0.9),  # the warm-up: not reported
            _move("copies", medium, "protect", 0, 0.50 * factor, transfer=0.45 * factor),
            _move("copies", medium, "protect", 1, 0.40 * factor, transfer=0.35 * factor),
            _move("copies", medium, "raw_plan", 0, 0.05),
            _move("copies", medium, "raw_plan", 1, 0.10),
            _move("copies", medium, "raw_duplex", 0, 0.04),
            _move("restore", medium, "peers", 0, 0.6 * factor, transfer=0.5),
            _move("restore", medium, "start", 0, 0.05, received=0, transfer=0.01),
            _move("restore", medium, "cold", 0, 0.2 * factor),
            _move("restore", medium, "cold", 1, 0.3 * factor),
        ]
    return {"bytes": 256 * MiB, "reps": 2, "saves": 5, "every": 3, "step_seconds": 1.0, "records": records}


def results(suite_: dict[str, Any] | None = None) -> dict[str, Any]:
    suites = {} if suite_ is None else {"copies": suite_}
    return {"profile": {"name": "quick"}, "started": "2026-01-01 00:00:00", "suites": suites}


def test_the_raw_baseline_moves_bytes_between_the_ranks_replicas_2_pairs_on_two_nodes() -> None:
    topology = Topology(job.WORLD, job.LOCAL)
    assert topology.nodes == 2
    for rank in range(job.WORLD):
        assert Replicas(2).targets(rank, topology) == [job.partner(rank)]
        assert job.node_of(rank) == topology.node_of(rank)
    assert job.chunks(70, 32) == [32, 32, 6] and job.chunks(0, 32) == []
    assert job.rotated(("a", "b", "c"), 4) == ("b", "c", "a")


def test_ranks_merge_into_the_slowest_time_and_every_ranks_bytes_and_cpu() -> None:
    def rank(r: int) -> list[dict[str, Any]]:
        loop = {
            "phase": "stall",
            "variant": "replicas",
            "rep": 0,
            "stalls": [0.5, 0.01 * (r + 1), 0.02, 0.03 * (r + 1)],  # the first: staging allocated
            "save_cpu": [0.3, 0.01, 0.01, 0.01],
            "busy": [False, False, r == 3, False],
            "rounds": [[0.1 * (r + 1), 10], [0.2, 10]],
            "loop": 10.0 + r,
            "cpu": 2.0,
            "bytes": 100,
        }
        moved = {"phase": "copies", "medium": "disk", "variant": "protect", "rep": 0}
        return [loop, {**moved, "seconds": 0.1 * (r + 1), "cpu": 0.5, "received": 64, "copies": 2 - (r == 1)}]

    stall, protect = job.merge([rank(r) for r in range(4)])
    assert stall["loop"] == 13.0 and stall["cpu"] == 8.0 and stall["bytes"] == 400
    assert stall["first_stall"] == 0.5 and stall["saves"] == 4
    assert stall["stall"] == pytest.approx(0.04) and stall["stall_max"] == pytest.approx(
        0.12
    )  # of 0.04, 0.02, 0.12
    assert stall["save_cpu"] == pytest.approx(0.04) and stall["overlapped"] == 1
    assert stall["rounds"] == [[pytest.approx(0.4), 40], [0.2, 40]]
    assert protect["seconds"] == pytest.approx(0.4) and protect["received"] == 256 and protect["cpu"] == 2.0
    assert protect["copies"] == 1  # the least protected rank's


def test_the_targets_compare_each_sides_best_and_say_a_missed_one_in_bold() -> None:
    made = copies.targets_part(results(suite()))
    rows = {row[0].split(" (")[0].split(",")[0]: row for row in _rows(made)}
    stall = rows["save stall"]
    assert stall[1:4] == ["1.05x", "<= 1.10x", "met"]  # 0.042 / 0.040, not the medians
    throughput = [row for row in _rows(made) if row[0].startswith("replication throughput")]
    # best round 0.40 s (tmpfs) against best raw 0.05 s: 0.125x; disk 0.80 s: 0.0625x
    assert [row[1] for row in throughput] == ["0.06x", "0.12x"]
    assert all(row[3].startswith("**missed**") for row in throughput)
    restore = [row for row in _rows(made) if row[0].startswith("restore")]
    assert [row[1] for row in restore] == ["3.00x", "3.00x"] and restore[0][2] == "reported"


def test_each_side_is_its_best_of_reps_with_the_spread_beside_it() -> None:
    stall = _rows(copies.stall_part(results(suite())))
    assert [row[0] for row in stall] == ["no copies", "`Replicas(2)`"]
    assert stall[0][1] == "0.040 (spread 1.25x)" and stall[1][1] == "0.042 (spread 1.43x)"
    assert stall[0][-1] == "-"
    assert (
        stall[1][-1]
        == "3 rounds of 256 MiB: 0.50 (spread 4.00x) s, 0.50 GiB/s at best; 1 of 10 saves began during one"
    )
    moved = _rows(copies.throughput_part(results(suite())))
    tmpfs_round = next(r for r in moved if r[0].startswith("tmpfs") and "whole" in r[1])
    assert tmpfs_round[3] == "0.400 (spread 1.25x)" and tmpfs_round[5] == "0.12x"
    assert tmpfs_round[4] == "0.62 (spread 1.25x)"  # 256 MiB in 0.4 s
    restored = _rows(copies.restore_part(results(suite())))
    assert [row[1].split(":")[0] for row in restored[:3]] == [
        "from the peers",
        "a manager's start, nothing lost",
        "from the cold tier",
    ]
    assert restored[0][-1] == "3.00x" and restored[2][-1] == "1.00x" and restored[1][2] == "0"


def test_the_parts_are_in_the_report_and_a_run_without_the_suite_leaves_them(tmp_path: Path) -> None:
    text = DOC.read_text()
    assert [name for name in render.parts(text) if name.startswith("copies")] == PARTS
    above = [line for line in text[: text.index("<!-- generated: copies.targets")].splitlines()]
    assert [line for line in above if line.startswith("## ")][-1].startswith("## Cold tier down")
    doc = tmp_path / "benchmarks.md"
    assert render.write(results(suite()), doc) == PARTS
    assert all(
        copies_part == ""
        for copies_part in (
            p(results(), tmp_path)
            for p in (copies.targets_part, copies.stall_part, copies.throughput_part, copies.restore_part)
        )
    )
    before = doc.read_text()
    assert render.write(results(), doc) == [] and doc.read_text() == before


def test_the_ranks_start_as_two_nodes_of_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, str]] = []

    class Done:
        returncode = 0

    def start(command: list[str], env: dict[str, str], **_: Any) -> Done:
        started.append(env)
        spec = json.loads(Path(command[-1]).read_text())
        rank = int(env["RANK"])
        record = {"phase": "copies", "medium": "disk", "variant": "raw_plan", "rep": 0, "seconds": 0.1 * rank}
        (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps([record]))
        return Done()

    monkeypatch.setattr(job, "start_rank", start)
    monkeypatch.setattr(job, "wait_ranks", lambda *_: None)
    monkeypatch.setattr(job, "kill_group", lambda _: None)
    (record,) = job.launch({"phases": []}, tmp_path / "work")
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) for e in started] == [
        ("0", "0", "2", "4"),
        ("1", "1", "2", "4"),
        ("2", "0", "2", "4"),
        ("3", "1", "2", "4"),
    ]
    assert record["seconds"] == pytest.approx(0.3)
