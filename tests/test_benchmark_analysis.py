"""The benchmark report's statistics (benchmarks/report/analysis.py, benchmarks/infra/stats.py)
on small synthetic records whose answers are worked out by hand: medians, best-ofs, per-rep
ratios, rates per GiB, and the targets built from them. Standard library only: the bench
extra (matplotlib) is not needed."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.infra.measure import GiB, MiB
from benchmarks.infra.stats import by_variant, merge_ranks, paired_ratios, summarize
from benchmarks.report import analysis as A


def rec(variant: str, rep: int, **fields: Any) -> dict[str, Any]:
    return {"variant": variant, "rep": rep, **fields}


def results(**suites: Any) -> dict[str, Any]:
    return {"suites": suites, "profile": {"hot_only_sizes": []}}


def target(found: list[A.Target], key: str) -> A.Target:
    (only,) = [t for t in found if t.key == key]
    return only


# -- statistics ------------------------------------------------------------------------------


def test_summarize_gives_median_min_max_and_count() -> None:
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4.0}


def test_by_variant_leaves_out_errors_and_missing_fields() -> None:
    records = [
        rec("a", 0, t=1.0),
        rec("a", 1, t=3.0),
        rec("a", 2, t=100.0, error="boom"),
        rec("b", 0),
        rec("b", 1, t=None),
        rec("c", 0, t=5.0),
    ]
    summaries = by_variant(records, "t")
    assert summaries["a"]["median"] == 2.0 and summaries["a"]["n"] == 2.0
    assert "b" not in summaries
    assert summaries["c"]["median"] == 5.0


def test_merge_ranks_takes_the_slowest_rank_and_sums_bytes_and_cpu() -> None:
    per_rank = [
        rec("x", 0, rank=0, stall=1.0, bytes=10, cpu=0.5),
        rec("x", 0, rank=1, stall=3.0, bytes=20, cpu=1.5),
        rec("x", 1, rank=0, stall=2.0, bytes=10, cpu=0.1),
        rec("x", 1, rank=1, stall=None, bytes=10, cpu=0.1, error="rank 1 failed"),
    ]
    merged = {m["rep"]: m for m in merge_ranks(per_rank, ("variant", "rep"), ("stall",), ("bytes", "cpu"))}
    assert merged[0] == {"variant": "x", "rep": 0, "stall": 3.0, "bytes": 30, "cpu": 2.0}
    assert merged[1]["stall"] == 2.0 and merged[1]["bytes"] == 20
    assert merged[1]["error"] == "rank 1 failed"


def test_paired_ratios_compare_cases_of_the_same_rep_only() -> None:
    records = [
        rec("num", 0, t=2.0),
        rec("den", 0, t=1.0),
        rec("num", 1, t=9.0),
        rec("den", 1, t=3.0),
        rec("num", 2, t=4.0),  # its baseline failed: no pair in rep 2
        rec("den", 2, t=4.0, error="boom"),
    ]
    pair = paired_ratios(records, "t", "num", "den")
    assert pair == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 2.0}
    assert paired_ratios(records, "t", "num", "absent") is None


def test_med_and_div_answer_none_for_what_is_missing() -> None:
    summaries = {"a": {"median": 3.0}}
    assert A.med(summaries, "a") == 3.0
    assert A.med(summaries, "b") is None
    assert A.div(3.0, 2.0) == 1.5
    assert A.div(3.0, 0.0) is None and A.div(None, 2.0) is None and A.div(1.0, None) is None


def test_throughput_is_bytes_over_time_per_variant() -> None:
    records = [
        rec("w", 0, bytes=100 * MiB, commit=2.0),
        rec("w", 1, bytes=100 * MiB, commit=4.0),
        rec("w", 2, bytes=100 * MiB, commit=1.0),
        rec("w", 3, bytes=100 * MiB, commit=0.0),
        rec("w", 4, bytes=100 * MiB, commit=1.0, error="failed"),
    ]
    rate = A.throughput(records, "commit")["w"]
    assert rate["median"] == 50 * MiB  # of 100, 50 and 25 MiB/s; zero durations are left out
    assert (rate["min"], rate["max"], rate["n"]) == (25 * MiB, 100 * MiB, 3.0)


def test_cpu_per_gib_scales_cpu_seconds_to_a_gib() -> None:
    records = [
        rec("w", 0, cpu=1.0, bytes=GiB // 2),
        rec("w", 1, cpu=4.0, bytes=GiB),
        rec("v", 0, cpu=0.0, bytes=GiB),
    ]
    per_gib = A.cpu_per_gib(records)
    assert per_gib["w"]["min"] == 2.0 and per_gib["w"]["max"] == 4.0
    assert "v" not in per_gib  # no CPU time recorded


def test_fsync_share_is_the_upper_median_of_the_disk_baselines_shares() -> None:
    records = [rec("disk_sync", r, fsync=f, commit=1.0) for r, f in enumerate((0.1, 0.6, 0.3, 0.4))]
    records.append(rec("fsw_sync", 0, fsync=0.9, commit=1.0))
    assert A.fsync_share(records) == {"median": 0.4, "min": 0.1, "max": 0.6}
    assert A.fsync_share([rec("fsw_sync", 0, fsync=0.5, commit=1.0)]) is None


def test_best_of_takes_the_smallest_value_per_variant() -> None:
    records = [
        rec("a", 0, t=3.0),
        rec("a", 1, t=1.5),
        rec("a", 2, t=0.1, error="x"),
        rec("b", 0, t=None),
        rec("b", 1, t=7.0),
    ]
    assert A.best_of(records, "t") == {"a": 1.5, "b": 7.0}


def test_paired_medians_of_a_cold_down_mode() -> None:
    records = []
    for rep, (sync, base) in enumerate(((2.0, 1.0), (3.0, 1.0), (1.0, 1.0))):
        records += [
            {"variant": "sync@stall", "kind": "sync", "against": "stall", "rep": rep, "commit": sync},
            {
                "variant": "sync@hot_only/stall",
                "kind": "sync",
                "against": "stall",
                "rep": rep,
                "commit": base,
            },
        ]
    # sync commit ratios 2, 3, 1: median 2; no async saves were measured
    assert A.paired_medians(records, "stall") == [2.0, None, None]
    assert A.paired_medians(records, "refuse") == [None, None, None]


def test_migration_states_add_up_sync_and_async() -> None:
    suite = {
        "migrations": {
            "sync@refuse": {"failed": 2, "pending": 1},
            "async@refuse": {"failed": 3},
            "sync@healthy": {"committed": 5},
        }
    }
    assert A.migration_states(suite, "refuse") == {"failed": 5, "pending": 1}
    assert A.migration_states(suite, "deny_writes") == {}


def test_ordered_puts_known_names_first_then_the_rest_alphabetically() -> None:
    assert A.ordered({"zeta", "b", "a", "alpha"}, ("b", "a")) == ["b", "a", "alpha", "zeta"]


# -- targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "value", "met"),
    [
        ("<=", 0.5, True),
        ("<=", 1.0, True),
        ("<=", 1.01, False),
        (">=", 1.0, True),
        (">=", 0.99, False),
        (">=", None, None),
    ],
)
def test_target_met_compares_value_and_bound(op: str, value: float | None, met: bool | None) -> None:
    t = A.Target("k", "1", "what", value, op, 1.0, "ours")
    assert t.met is met
    assert A.verdict(t) == {True: "met", False: "**missed**", None: "not measured"}[met]


def test_formats_of_ratios_and_percentages() -> None:
    ratio = A.Target("k", "1", "what", 0.9876, "<=", 1.1, "ours")
    share = A.Target("k", "load", "what", 0.031, "<=", 0.05, "design", unit="%")
    assert (A.fmt_value(ratio), A.fmt_bound(ratio)) == ("0.988x", "<= 1.10x")
    assert (A.fmt_value(share), A.fmt_bound(share)) == ("+3.1%", "<= 5%")
    assert A.fmt_value(A.Target("k", "1", "what", None, "<=", 1.0, "ours")) == "n/a"


def save_suite() -> dict[str, Any]:
    """Two reps at 256 MiB: fsw_sync stalls 1 and 3 s, tiered_async 0.1 and 0.3 s."""
    size = 256 * MiB
    records = []
    for rep, scale in enumerate((1.0, 3.0)):
        records += [
            rec("fsw_sync", rep, stall=1.0 * scale, commit=1.0 * scale, bytes=size, growth_save=100.0),
            rec("fsw_async", rep, stall=0.2 * scale, commit=1.0 * scale, bytes=size, growth_save=200.0),
            rec("tiered_sync", rep, stall=1.0 * scale, commit=0.5 * scale, bytes=size, growth_save=120.0),
            rec("tiered_async", rep, stall=0.1 * scale, commit=1.0 * scale, bytes=size, growth_save=200.0),
            rec("disk_sync", rep, stall=0.25 * scale, commit=0.25 * scale, bytes=size),
        ]
    return {str(size): records}


def test_stall_targets_are_ratios_of_median_stalls() -> None:
    found = A.stall_targets(results(save=save_suite()))
    assert [t.key for t in found] == ["stall_fsw_async", "stall_fsw_sync"]  # no fsspec writer ran
    assert target(found, "stall_fsw_async").value == pytest.approx(0.2 / 0.4)
    assert target(found, "stall_fsw_sync").value == pytest.approx(0.2 / 2.0)
    assert all(t.met for t in found)
    assert "256 MiB, 2 ranks" in found[0].what


def test_hot_targets_carry_the_per_rep_band_and_the_cpu_ratio() -> None:
    suite = save_suite()
    for r in suite[str(256 * MiB)]:
        r["cpu"] = {"tiered_sync": 1.0, "fsw_sync": 2.0}.get(r["variant"])
    found = A.hot_targets(results(save=suite))
    fsw = target(found, "hot_fsw")
    assert fsw.value == pytest.approx(2.0)  # commits in half the time
    assert fsw.detail == "per-rep 2.00x .. 2.00x; CPU time 0.50x"
    disk = target(found, "hot_disk")
    assert disk.value == pytest.approx(0.5) and disk.met is False  # target >= 0.8


def test_memory_targets_compare_peak_growth_of_the_same_mode() -> None:
    found = A.memory_targets(results(save=save_suite()))
    assert target(found, "memory_save_sync").value == pytest.approx(1.2)
    assert target(found, "memory_save_sync").met is False
    assert target(found, "memory_save_async").value == pytest.approx(1.0)


def test_latency_targets_compare_the_highest_delay_with_none() -> None:
    records = [
        rec(f"{writer}@{ms}ms", rep, stall=stall)
        for rep in range(2)
        for writer, stalls in (
            ("tiered_async", {0: 1.0, 200: 1.1}),
            ("fsspec_sync", {0: 1.0, 50: 2.0, 200: 4.0}),
        )
        for ms, stall in stalls.items()
    ]
    suite = {"latency": {"records": records}}
    assert A.latency_summary(results(**suite))["fsspec_sync"] == {0: 1.0, 50: 2.0, 200: 4.0}
    found = A.latency_targets(results(**suite))
    assert target(found, "latency_tiered_async").value == pytest.approx(1.1)
    assert target(found, "latency_fsspec_sync").value == pytest.approx(4.0)
    assert all(t.met for t in found)


def migration_suite() -> dict[str, Any]:
    records = []
    for rep in range(2):
        records += [
            {
                "variant": "tiered",
                "group": "sweep",
                "inflight": 4,
                "rep": rep,
                "bytes": 256 * MiB,
                "seconds": 2.0,
                "growth": 80.0,
            },
            {
                "variant": "s3fs",
                "group": "sweep",
                "inflight": 4,
                "rep": rep,
                "bytes": 256 * MiB,
                "seconds": 1.0,
                "growth": 40.0,
            },
        ]
    records += [
        {
            "variant": "tiered",
            "group": "sizes",
            "inflight": 4,
            "rep": 0,
            "bytes": 128 * MiB,
            "seconds": 1.0,
            "growth": g,
        }
        for g in (60.0, 64.0)
    ]
    return {"records": records, "default_inflight": 4, "part_size": 16 * MiB}


def test_migration_rates_are_mib_per_second_by_parts_in_flight() -> None:
    rates = A.migration_rates(results(migration=migration_suite()))
    assert rates["tiered"][4]["median"] == pytest.approx(128.0)
    assert rates["s3fs"][4]["median"] == pytest.approx(256.0)


def test_migration_memory_is_the_median_growth_by_size() -> None:
    memory = A.migration_memory(results(migration=migration_suite()))
    assert memory == {"tiered": {256 * MiB: 80.0, 128 * MiB: 64.0}, "s3fs": {256 * MiB: 40.0}}


def test_migration_targets() -> None:
    found = A.migration_targets(results(migration=migration_suite()))
    speed = target(found, "migration")
    assert speed.value == pytest.approx(0.5) and speed.met is False
    assert speed.detail.startswith("per-rep 0.50x .. 0.50x")
    flat = target(found, "migration_memory_flat")  # 256 MiB over 128 MiB
    assert flat.value == pytest.approx(80.0 / 64.0) and flat.met is True
    assert target(found, "migration_memory").value == pytest.approx(2.0)


def test_load_targets_and_the_checksum_a_b() -> None:
    records = []
    for rep in range(3):
        records += [
            rec("fsr_hot", rep, load=1.0),
            rec("tiered_hot", rep, load=1.25),
            rec("fsr_hot_warm", rep, load=0.5),
            rec("tiered_hot_warm", rep, load=0.5, cpu=1.0 + 0.02 * rep),
            rec("tiered_hot_nocrc_warm", rep, load=0.5, cpu=1.0),
            rec("fsspec_cold", rep, load=2.0),
            rec("tiered_cold", rep, load=2.0),
            rec("crc_only", rep, load=0.01),
        ]
    found = A.load_targets(results(load={"records": records}))
    assert target(found, "load_hot").value == pytest.approx(0.8)
    assert target(found, "load_hot_warm").value == pytest.approx(1.0)
    assert target(found, "crc").value == pytest.approx(0.02) and target(found, "crc").met
    ab = target(found, "crc_ab")  # CPU with / without CRC: 1.00, 1.02, 1.04 -> median 1.02
    assert ab.value == pytest.approx(0.02) and ab.unit == "%"
    assert ab.detail == "per-rep +0% .. +4%"


def test_scaling_targets_one_per_world_size() -> None:
    by_ranks = {
        str(w): [rec("fsw_sync", 0, commit=1.0), rec("tiered_sync", 0, commit=c)]
        for w, c in ((1, 0.9), (4, 1.2))
    }
    found = A.scaling_targets(results(scaling={"by_ranks": by_ranks}))
    assert [(t.key, t.met) for t in found] == [("scaling_1", True), ("scaling_4", False)]


def test_without_measurements_no_target_is_met_or_missed() -> None:
    assert all(t.met is None for t in A.all_targets(results()))
