"""The perf suite's pieces (the targets of the raw encoding and of the staging paid once): the
state it saves, the best-of loop, the CPU accounting of child processes, the CRC32C A/B switch,
and the report's targets, verdicts and reasons computed from records. No timing is asserted:
the records are made up, or the measured quantity is CPU time a child reported itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.infra.measure import MiB, tree_cpu_seconds
from benchmarks.jobs import perf_common
from benchmarks.report import perf


def test_the_state_is_a_model_and_its_optimizer_in_tensors_of_mixed_sizes() -> None:
    state = perf_common.make_state(32 * MiB)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    assert 0.95 * 32 * MiB <= perf_common.nbytes(state) <= 32 * MiB
    assert min(sizes) == 4 and max(sizes) >= 1 * MiB
    model = [k for k in tensors if k.startswith("model.")]
    assert all(f"optim.{k[6:]}.exp_avg_sq" in tensors for k in model)
    assert state["train.progress"]["step"] == 1000
    blank = perf_common.blank_like(state)
    assert blank.keys() == state.keys() and blank["train.progress"] == dict.fromkeys(
        state["train.progress"], -1
    )


def test_best_of_records_a_failing_case_once_and_rotates_the_order() -> None:
    calls: list[str] = []

    def case(name: str) -> Any:
        return lambda: calls.append(name) and None

    def broken() -> None:
        raise RuntimeError("no such feature")

    prepared: list[str] = []
    cases: dict[str, perf_common.Case] = {
        "a": case("a"),
        "b": (lambda: prepared.append("b"), case("b")),
        "bad": broken,
    }
    records = perf_common.best_of(cases, 100, 2, op="save")
    assert calls == ["a", "b", "a", "b", "b", "a"]  # warm-up, rep 0, rep 1 rotated
    assert prepared == ["b"] * 3
    bad = [r for r in records if r["variant"] == "bad"]
    assert len(bad) == 1 and bad[0]["error"] == "RuntimeError: no such feature"
    timed = [r for r in records if r["variant"] != "bad"]
    assert len(timed) == 4 and all(r["op"] == "save" and r["cpu"] >= 0 for r in timed)


def test_tree_cpu_counts_the_cpu_of_a_live_child() -> None:
    code = (
        "import os, sys, time\nx = 0\nfor i in range(3_000_000): x += i\n"
        "t = os.times()\nprint(t.user + t.system, flush=True)\ntime.sleep(30)\n"
    )
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        spent = float(child.stdout.readline())
        assert tree_cpu_seconds() - before >= spent - 0.02  # clock ticks round down
    finally:
        child.kill()
        child.wait()


def test_accepts_reads_a_signature() -> None:
    def writer(path: str, *, encoding: str = "raw") -> None: ...

    assert perf_common.accepts(writer, "encoding") and not perf_common.accepts(writer, "staging")
    found = perf_common.features()
    assert set(found) == {"encoding", "reader_threads", "staging", "direct_io", "verify_blocks"}
    assert all(v is None or (isinstance(v, str) and v) for v in found.values())


def test_the_unverified_arm_disables_verify_blocks_only_inside() -> None:
    encoding = pytest.importorskip("tierstore.format.encoding")
    if not hasattr(encoding, "verify_blocks"):
        pytest.skip("verify_blocks not landed")
    from benchmarks.jobs.perf_io import verification

    original = encoding.verify_blocks
    with verification(False):
        assert encoding.verify_blocks is not original
        assert encoding.verify_blocks(b"anything", "at all") is None
    assert encoding.verify_blocks is original


def _cached_bytes(path: Path) -> int | None:
    answer = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True
    )
    return int(answer.stdout.split()[0]) if answer.returncode == 0 and answer.stdout else None


def test_cold_loads_drop_the_files_from_the_page_cache(tmp_path: Path) -> None:
    data = tmp_path / "ckpt" / "data"
    data.parent.mkdir()
    data.write_bytes(b"x" * (4 * MiB))
    perf_common.read_through(tmp_path)
    if _cached_bytes(data) != 4 * MiB:
        pytest.skip("fincore missing, or this filesystem shows no page cache")
    perf_common.drop_from_cache(tmp_path)
    dropped = _cached_bytes(data)
    if (
        dropped == 4 * MiB
        and subprocess.run(
            ["stat", "-f", "-c", "%T", str(data)], text=True, capture_output=True
        ).stdout.strip()
        == "tmpfs"
    ):
        pytest.skip("tmpfs: its pages are the file, nothing to drop")
    assert dropped == 0


# -- the report --------------------------------------------------------------------------------

SIZE = 1 << 30


def io_record(
    op: str,
    variant: str,
    place: str,
    seconds: float,
    cpu: float,
    cache: str | None = None,
    rep: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "op": op,
        "variant": variant,
        "place": place,
        "rep": rep,
        "bytes": SIZE,
        "seconds": seconds,
        "cpu": cpu,
        **({"cache": cache} if cache else {}),
        **extra,
    }


def perf_results(raw: bool = True) -> dict[str, Any]:
    io = [
        io_record("save", "fsw", "tmpfs", 2.0, 2.0),
        io_record("save", "fsw", "tmpfs", 1.0, 1.5, rep=1),
        io_record("save", "raw_write", "disk", 1.0, 0.2, fsync=0.6),
        io_record("save", "fsw", "disk", 3.0, 2.0),
        io_record("load", "fsr", "tmpfs", 1.0, 1.0, "warm"),
        io_record("load", "fsr", "disk", 1.0, 1.0, "warm"),
        io_record("load", "fsr", "disk", 4.0, 1.0, "cold"),
        io_record("crc", "crc_on", "tmpfs", 0.5, 0.40),
        io_record("crc", "crc_off", "tmpfs", 0.4, 0.36),
    ]
    if raw:
        io += [
            io_record("save", "tiered_raw", "tmpfs", 0.5, 0.6),
            io_record("save", "tiered_raw", "disk", 1.5, 0.6),
            io_record("load", "tiered_raw_t1", "tmpfs", 0.6, 0.4, "warm"),
            io_record("load", "tiered_raw_t4", "tmpfs", 0.5, 0.45, "warm"),
            io_record("load", "tiered_raw_t1", "disk", 0.5, 0.4, "warm"),
            io_record("load", "tiered_raw_t1", "disk", 3.0, 0.6, "cold"),
        ]
    else:
        io += [
            {
                "variant": "tiered_raw",
                "rep": 0,
                "op": "save",
                "place": "tmpfs",
                "unavailable": "TieredWriter takes no encoding=",
            }
        ]
    stall = [
        {
            "variant": v,
            "rep": i,
            "first": i == 0,
            "bytes": SIZE,
            "stall": s * (3 if i == 0 else 1),
            "staged": s,
            "durable": 2.0,
            "cpu": c,
        }
        for i in range(3)
        for v, s, c in (
            ("sync_tiered", 2.0, 2.0),
            ("ours_reuse", 0.05, 1.0),
            ("dcp_async", 0.01, 1.5),
            ("torch_checkpointing", 0.001, 0.8),
        )
    ]
    stall.append({"variant": "dcp_async_cached", "rep": 0, "error": "RuntimeError: needs CUDA"})
    features = {"encoding": None if raw else "TieredWriter takes no encoding="}
    return {
        "started": "2026-12-01 00:00:00",
        "suites": {
            "perf": {
                "io": {
                    "bytes": SIZE,
                    "reps": 2,
                    "tensors": 265,
                    "largest": 8 * MiB,
                    "smallest": 4,
                    "features": features,
                    "crc_hardware": True,
                    "records": io,
                    "load_checks": {"disk": {"tiered_raw_t4": "loaded values differ"}},
                },
                "stall": {"bytes": SIZE, "saves": 3, "hot": "tmpfs", "features": features, "records": stall},
            }
        },
    }


def by_key(results: dict[str, Any]) -> dict[str, Any]:
    return {t.key: t for t in perf.perf_targets(results)}


def test_targets_compare_the_best_of_each_side() -> None:
    t = by_key(perf_results())
    assert t["save_cpu"].value == pytest.approx(0.6 / 1.5) and perf.met(t["save_cpu"])
    assert t["save_tmpfs"].value == pytest.approx(1.0 / 0.5) and perf.met(t["save_tmpfs"])
    assert t["save_disk"].value == pytest.approx(1.0 / 1.5) and perf.met(t["save_disk"]) is False
    assert (
        t["load_cpu_tmpfs_warm"].value == pytest.approx(0.4)
        and "tiered_raw_t1" in t["load_cpu_tmpfs_warm"].detail
    )
    assert t["load_rate_tmpfs_warm"].value == pytest.approx(2.0) and "t4" in t["load_rate_tmpfs_warm"].detail
    assert t["load_rate_disk_cold"].value == pytest.approx(4.0 / 3.0)
    assert t["crc_share"].value == pytest.approx(0.1) and perf.met(t["crc_share"]) is False


def test_stall_targets_use_the_steady_state_and_the_peers() -> None:
    t = by_key(perf_results())
    assert t["stall"].value == pytest.approx(0.05 / 2.0) and perf.met(t["stall"])
    assert t["peer_stall_dcp_async"].value == pytest.approx(5.0)
    assert perf.verdict(t["peer_stall_dcp_async"]) == "**missed**"
    assert t["peer_cpu_dcp_async"].value == pytest.approx(1.0 / 1.5)
    assert perf.verdict(t["peer_cpu_dcp_async"]) == "met"
    assert perf.met(t["peer_cpu_torch_checkpointing"]) is False


def test_a_feature_not_landed_is_not_measured() -> None:
    t = by_key(perf_results(raw=False))
    assert t["save_cpu"].value is None and perf.verdict(t["save_cpu"]) == "not measured"


def test_the_parts_show_every_target_and_every_case_that_did_not_run(tmp_path: Path) -> None:
    from benchmarks.report import plots

    for raw in (True, False):
        results = perf_results(raw)
        targets = "\n".join(
            part(results, tmp_path)
            for part in (perf.stall_targets_part, perf.save_targets_part, perf.load_targets_part)
        )
        for target in perf.perf_targets(results):
            assert f"| {target.what} | " in targets
        assert "| **missed** |" in targets
    assert "| `dcp_async_cached` | n/a | n/a | n/a | n/a |  | failed: RuntimeError: needs CUDA |" in (
        perf.stall_part(results, tmp_path)
    )
    assert "- `disk/tiered_raw_t4`: loaded values differ" in perf.load_part(results, tmp_path)
    if plots.plt is not None:  # the figure, where matplotlib (the bench extra) is installed
        assert (tmp_path / "perf_stall.png").stat().st_size > 0


def test_a_run_of_the_perf_suite_alone_updates_its_parts_alone(tmp_path: Path) -> None:
    from benchmarks.report import render

    doc = tmp_path / "benchmarks.md"
    assert render.write(perf_results(), doc) == [
        "perf.stall.targets",
        "perf.stall",
        "perf.save.targets",
        "perf.save",
        "perf.load.targets",
        "perf.load",
    ]
