"""Metrics recorded with a save, and ``keep_best`` retention by them (issue 16 item 5).

Real saves (single process: DCP runs without a process group) record metrics in the manifest,
flat and two-level; ``CheckpointInfo.metrics`` and the real ``tierstore`` command show them;
``keep_best`` picks by metric and mode, never a checkpoint without the metric, composes with
``keep_last``, and a prune with it deletes exactly what it should. Forged metrics are refused.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import (
    CheckpointManager,
    Retention,
    StagingOptions,
    Store,
    TieredReader,
    TieredWriter,
    keep_last,
    list_checkpoints,
    prune,
)
from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format import layout
from tierstore.format import manifest_format as fmt
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.retention import keep_best, keep_every

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TIERSTORE = str(Path(sys.executable).with_name("tierstore"))  # the installed console script
# step -> val_loss, acc: the lowest losses are steps 2 and 4, the highest accuracies 1 and 5.
RUN = {1: (0.90, 0.80), 2: (0.40, 0.30), 3: (0.70, 0.20), 4: (0.45, 0.10), 5: (0.80, 0.90)}


@dataclass(frozen=True)
class Ckpt:
    name: str
    step: int | None
    created: float
    metrics: dict[str, float] = field(default_factory=dict, hash=False)


def ckpt(step: int, **metrics: float) -> Ckpt:
    return Ckpt(layout.default_name(step), step, 1000.0 + step, metrics)


def steps(names: frozenset[str] | set[str]) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in names)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(256.0) * step, "step": torch.tensor(step)}


def save(hot: str, step: int, metrics: dict[str, float] | None, **options: Any) -> Manifest:
    writer = TieredWriter(hot, step=step, metrics=metrics, **options)
    dcp.save(state(step), storage_writer=writer)
    assert writer.manifest is not None
    return writer.manifest


def saved_run(hot: str) -> None:
    """Steps 1-5 with their metrics; step 6 without any (it must never be "best")."""
    for step, (loss, acc) in RUN.items():
        save(hot, step, {"val_loss": loss, "acc": acc})
    save(hot, 6, None)


def manifest_path(hot: str, step: int) -> Path:
    return Path(hot, layout.manifest_key(layout.default_name(step)))


# -- keep_best, pure ------------------------------------------------------------------------


def test_keep_best_picks_by_metric_and_mode() -> None:
    found = [ckpt(s, val_loss=loss, acc=acc) for s, (loss, acc) in RUN.items()]
    assert steps(keep_best("val_loss", 2).keep(found, now=0)) == [2, 4]
    assert steps(keep_best("val_loss", 2, mode="min").keep(found, now=0)) == [2, 4]
    assert steps(keep_best("acc", 2, mode="max").keep(found, now=0)) == [1, 5]
    # The same metric, the other way round: a policy that ignored its mode would give one
    # answer to both.
    assert steps(keep_best("val_loss", 2, mode="max").keep(found, now=0)) == [1, 5]
    assert steps(keep_best("acc", 1, mode="min").keep(found, now=0)) == [4]
    assert keep_best("val_loss", 0).keep(found, now=0) == frozenset()
    assert steps(keep_best("val_loss", 99).keep(found, now=0)) == [1, 2, 3, 4, 5]


def test_a_checkpoint_without_the_metric_is_never_best() -> None:
    found = [
        ckpt(1, val_loss=0.5),
        ckpt(2),
        ckpt(3, acc=0.1),
        ckpt(4, val_loss=0.9),
        Ckpt("legacy", 5, 1005.0),
    ]  # no metrics at all: a Checkpoint of another kind
    for mode in ("min", "max"):
        assert steps(keep_best("val_loss", 5, mode=mode).keep(found, now=0)) == [1, 4]
    assert keep_best("loss", 3).keep(found, now=0) == frozenset()


def test_equal_values_keep_the_newer() -> None:
    found = [ckpt(1, val_loss=0.5), ckpt(2, val_loss=0.5), ckpt(3, val_loss=0.5)]
    assert steps(keep_best("val_loss", 2).keep(found, now=0)) == [2, 3]


def test_keep_best_composes_with_the_other_policies() -> None:
    found = [ckpt(s, val_loss=loss) for s, (loss, _) in RUN.items()] + [ckpt(10)]
    policy = keep_last(1) | keep_best("val_loss", 2)
    assert steps(policy.keep(found, now=0)) == [2, 4, 10]  # newest | the 2 best
    assert steps((keep_every(5) | keep_best("val_loss", 1, "max")).keep(found, now=0)) == [1, 5, 10]
    assert repr(policy) == "keep_last(n=1) | keep_best(metric='val_loss', k=2, mode='min')"


@pytest.mark.parametrize(
    "args",
    [("val loss", 1), ("", 1), ("x" * 65, 1), ("val_loss", -1), ("val_loss", True), ("val_loss", 1, "best")],
)
def test_keep_best_refuses_bad_arguments(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        keep_best(*args)


# -- metrics in the manifest ----------------------------------------------------------------


def test_metrics_land_in_the_manifest_and_checkpoint_info(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, {"val_loss": 0.41, "acc": 1, "eval/ppl": 12.5})  # an int is stored as a float
    save(hot, 2, None)
    body = json.loads(manifest_path(hot, 1).read_bytes())
    assert body["metrics"] == {"val_loss": 0.41, "acc": 1.0, "eval/ppl": 12.5}
    assert isinstance(body["metrics"]["acc"], float)
    assert "metrics" not in json.loads(manifest_path(hot, 2).read_bytes())  # absent, not {}
    infos = list_checkpoints(hot)
    assert [i.metrics for i in infos] == [{"val_loss": 0.41, "acc": 1.0, "eval/ppl": 12.5}, {}]


def test_a_manifest_without_metrics_is_byte_identical_to_before() -> None:
    files = [fmt.FileEntry(".metadata", 10, 1, 0), fmt.FileEntry("__0_0.distcp", 5, 2, 0)]
    args = ("step-0000000001", 1, "20261129T081814Z-3fa2b1c4", 1, 1.0, files)
    plain = Manifest(*args).to_json()
    assert Manifest(*args, metrics={}).to_json() == plain == Manifest(*args, metrics=None).to_json()
    # What the version without the field wrote: the same body, self-checksummed the same way.
    body = {
        "attempt": args[2],
        "created": 1.0,
        "files": [f.to_dict() for f in files],
        "format": fmt.FORMAT,
        "metadata_file": ".metadata",
        "name": args[0],
        "producer": "",
        "step": 1,
        "version": 1,
        "world_size": 1,
    }
    assert plain == fmt.encode_root(body)
    measured = Manifest(*args, metrics={"val_loss": 0.5})
    assert measured != Manifest(*args) and Manifest.from_json(measured.to_json()) == measured


def test_a_two_level_manifest_records_metrics_in_its_root(tmp_path: Path) -> None:
    files = [fmt.FileEntry(".metadata", 10, 1, 0)] + [
        fmt.FileEntry(f"__{r}_0.distcp", 5, 2, r) for r in range(4)
    ]
    manifest = Manifest(
        "step-0000000001",
        1,
        "20261129T081814Z-3fa2b1c4",
        4,
        1.0,
        files,
        part_ranks=2,
        metrics={"val_loss": 0.25},
    )
    root = json.loads(manifest.to_json())
    assert root["version"] == 2 and root["metrics"] == {"val_loss": 0.25}
    assert Manifest.from_json(manifest.to_json()).metrics == {"val_loss": 0.25}


def test_metrics_travel_to_the_cold_tier(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    writer = TieredWriter(hot, cold, step=3, metrics={"val_loss": 0.3})
    dcp.save(state(3), storage_writer=writer)
    assert writer.migrator is not None and writer.migrator.wait(60)
    [info] = list_checkpoints(Store(cold=cold))
    assert info.tiers == ("cold",) and info.metrics == {"val_loss": 0.3}


@pytest.mark.parametrize(
    "metrics",
    [
        {"val_loss": math.nan},
        {"val_loss": math.inf},
        {"val_loss": -math.inf},
        {"val loss": 1.0},
        {"": 1.0},
        {"x" * 65: 1.0},
        {"val_loss": True},
        {"val_loss": "0.4"},
        {"val_loss": None},
        {"val_loss": [0.4]},
        {"val_loss": torch.tensor(0.4)},
        {1: 0.4},
        {"a\n": 1.0},
        {f"m{i}": float(i) for i in range(65)},
        [("val_loss", 0.4)],
        {"val_loss": 10**400},
    ],
)
def test_bad_metrics_are_refused_before_anything_is_saved(tmp_path: Path, metrics: Any) -> None:
    hot = str(tmp_path / "hot")
    with pytest.raises(ConfigError, match="metric"):
        TieredWriter(hot, step=1, metrics=metrics)
    manager = CheckpointManager(hot, save_every=1)
    with pytest.raises(ConfigError, match="metric"):
        manager.save(1, state(1), metrics=metrics)
    manager.close()
    assert list_checkpoints(hot) == [] and manager.health().saves_failed == 0


def test_the_most_metrics_allowed_are_kept(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    metrics = {f"{'m' * 60}{i:04d}": -1.2345678901234567e300 * i for i in range(fmt.MAX_METRICS)}
    save(hot, 1, metrics)
    assert list_checkpoints(hot)[0].metrics == metrics


FORGED: list[Any] = [
    {"val_loss": "NaN"},
    {"val_loss": "Infinity"},
    {"bad name": 1.0},
    {},
    [],
    "0.4",
    {"a": {"b": 1.0}},
    {"val_loss": False},
    {f"m{i}": 1.0 for i in range(fmt.MAX_METRICS + 1)},
    {"x" * 65: 1.0},
]


@pytest.mark.parametrize("forged", FORGED, ids=[str(i) for i in range(len(FORGED))])
def test_forged_metrics_are_refused_as_an_invalid_manifest(tmp_path: Path, forged: Any) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, {"val_loss": 0.5})
    path = manifest_path(hot, 1)
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    # Re-checksummed, so only the metrics can give the forgery away. "NaN"/"Infinity" are
    # written as the bare JSON tokens Python's json module reads back as floats.
    body["metrics"] = (
        {k: math.nan if v == "NaN" else math.inf if v == "Infinity" else v for k, v in forged.items()}
        if isinstance(forged, dict)
        else forged
    )
    path.write_bytes(fmt.encode_root(body))
    with pytest.raises(InvalidManifest, match="metric") as caught:
        Manifest.from_json(path.read_bytes(), key=str(path), tier="hot")
    assert caught.value.key == str(path) and caught.value.tier == "hot"
    assert list_checkpoints(hot) == []  # an invalid manifest commits nothing
    assert (
        "no committed checkpoints"
        in subprocess.run([TIERSTORE, "ls", "--hot", hot], capture_output=True, text=True, timeout=120).stdout
    )


def test_forged_root_metrics_are_refused(tmp_path: Path) -> None:
    files = [fmt.FileEntry(".metadata", 10, 1, 0)] + [
        fmt.FileEntry(f"__{r}_0.distcp", 5, 2, r) for r in range(4)
    ]
    root = json.loads(
        Manifest("step-0000000001", 1, "20261129T081814Z-3fa2b1c4", 4, 1.0, files, part_ranks=2).to_json()
    )
    root.pop("checksum")
    root["metrics"] = {"val_loss": math.nan}
    with pytest.raises(InvalidManifest, match="val_loss"):
        Manifest.from_json(fmt.encode_root(root))


# -- the manager and prune use keep_best as any other policy -----------------------------------


@pytest.mark.parametrize(
    "mode",
    [StagingOptions(async_save=False), StagingOptions(), StagingOptions(overlap=True)],
    ids=["sync", "async", "overlap"],
)
def test_the_manager_records_each_saves_metrics_and_keeps_the_best(
    tmp_path: Path, mode: StagingOptions
) -> None:
    hot = str(tmp_path / "hot")
    policy = keep_last(1) | keep_best("val_loss", 2)
    manager = CheckpointManager(hot, save_every=1, retention=Retention(hot=policy), staging=mode)
    for step, (loss, acc) in RUN.items():
        # Async saves overlap the next one: each must commit its own save's metrics.
        manager.save(step, state(step), metrics={"val_loss": loss, "acc": acc})
        if mode.overlap:
            manager.wait_staged()
    manager.save(6, state(6))  # no metrics: kept only as the newest
    manager.close()
    assert manager.health().ok, manager.health()
    infos = list_checkpoints(hot)
    assert [(i.step, i.metrics) for i in infos] == [
        (2, {"val_loss": 0.40, "acc": 0.30}),
        (4, {"val_loss": 0.45, "acc": 0.10}),
        (6, {}),
    ]


def test_a_prune_with_keep_best_deletes_what_it_should_and_nothing_else(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    saved_run(hot)
    before = {i.name: i for i in list_checkpoints(hot)}
    [report] = prune(hot, hot_policy=keep_last(1) | keep_best("acc", 2, mode="max"))
    assert steps(set(report.deleted)) == [2, 3, 4] and not report.errors
    assert steps(set(report.kept)) == [1, 5, 6]
    after = list_checkpoints(hot)
    assert [i.step for i in after] == [1, 5, 6]
    assert all(i == before[i.name] for i in after)  # the kept ones are untouched
    dirs = {p.name for p in Path(hot, "checkpoints").iterdir()}
    assert dirs == {layout.default_name(s) for s in (1, 5, 6)}  # the pruned data is gone
    for info in after:  # and the kept ones load, bit for bit
        target = {"w": torch.zeros(256), "step": torch.tensor(0)}
        dcp.load(target, storage_reader=TieredReader(hot, name=info.name))
        assert torch.equal(target["w"], state(info.step or 0)["w"])


# -- the tierstore command --------------------------------------------------------------------


def tierstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TIERSTORE, *args], capture_output=True, text=True, timeout=120)


def test_ls_and_show_print_metrics(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, {"val_loss": 0.41, "acc": 0.875})
    save(hot, 2, None)
    ls = tierstore("ls", "--hot", hot)
    assert ls.returncode == 0, ls.stderr
    header, first, second = ls.stdout.splitlines()
    assert header.split()[-2:] == ["migration", "metrics"]
    assert first.startswith(layout.default_name(1)) and first.endswith("acc=0.875 val_loss=0.41")
    assert second.startswith(layout.default_name(2)) and "=" not in second
    rows = json.loads(tierstore("ls", "--hot", hot, "--json").stdout)
    assert [r["metrics"] for r in rows] == [{"val_loss": 0.41, "acc": 0.875}, {}]
    show = tierstore("show", "--hot", hot, "--step", "1")
    assert show.returncode == 0 and "metrics: acc=0.875 val_loss=0.41" in show.stdout.splitlines()
    plain = tierstore("show", "--hot", hot, "--step", "2").stdout.splitlines()
    assert plain and not any(line.startswith("metrics:") for line in plain)
    body = json.loads(tierstore("show", "--hot", hot, "--step", "1", "--json").stdout)
    assert body["metrics"] == {"val_loss": 0.41, "acc": 0.875}
    assert json.loads(tierstore("show", "--hot", hot, "--step", "2", "--json").stdout)["metrics"] == {}


def test_ls_without_metrics_has_no_metrics_column(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, None)
    header = tierstore("ls", "--hot", hot).stdout.splitlines()[0]
    assert header.split()[-1] == "migration"


def test_prune_command_keeps_the_best(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    saved_run(hot)
    dry = tierstore("prune", "--hot", hot, "--hot-keep-last", "1", "--hot-keep-best", "val_loss:2")
    assert dry.returncode == 0, dry.stderr
    assert len(list_checkpoints(hot)) == 6  # a dry run
    done = tierstore("prune", "--hot", hot, "--hot-keep-best", "acc:1:max", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    assert [i.step for i in list_checkpoints(hot)] == [5, 6]  # the best, and the newest
    for bad in ("val_loss", "val_loss:x", "val_loss:2:best", "bad name:2"):
        run = tierstore("prune", "--hot", hot, "--hot-keep-best", bad)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
