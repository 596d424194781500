"""Defects an outside test found (issue 22, item 5), each on real storage: local directories.

Run locks and leases a hostile or mistaken store holds, a step no manifest can record, a
mistyped tier URL, a save failure crossing a process boundary, prune errors the command
hid, and the torch_checkpointing storage's streamed read falling back to the cold tier.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import committed, file_path, save, state_for

from tierstore import Retention, StagingOptions, TieredReader, TieredWriter
from tierstore.cli import main
from tierstore.dcp.failures import save_failed
from tierstore.errors import CheckpointExists, ConfigError, SaveFailed, TierstoreError
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.manager import CheckpointManager
from tierstore.tiers import leases, runlock
from tierstore.tiers.tier import Tier

YEAR = 365 * 24 * 3600.0


# -- 1. run locks a hostile store holds -------------------------------------------------------


def plant_run_lock(hot: Path, **fields: object) -> Path:
    """A run lock of another job, as ``runs/<run>/<beat>.json``, with ``fields`` overriding."""
    run = uuid.uuid4().hex
    body = {
        "run": run,
        "job": "planted",
        "host": "elsewhere",
        "pid": 4242,
        "pid_space": "",
        "ttl": 600.0,
        **fields,
    }
    path = hot / layout.run_lock_key(run, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))  # Infinity and NaN as Python's json writes them
    return path


HOSTILE_LOCKS = {
    "pid infinite": {"pid": float("inf")},
    "pid a huge float": {"pid": 1e300},
    "pid beyond any pid_t, on this machine": {"pid": 10**30, "pid_space": runlock._pid_space()},
    "pid a string": {"pid": "4242"},
    "pid a bool": {"pid": True},
    "pid negative": {"pid": -5},
    "job a list": {"job": ["a", "b"]},
    "ttl a string": {"ttl": "600"},
    "ttl nan": {"ttl": float("nan")},
}


@pytest.mark.parametrize("fields", list(HOSTILE_LOCKS.values()), ids=list(HOSTILE_LOCKS))
def test_a_hostile_run_lock_is_ignored_at_start(tmp_path: Path, fields: dict[str, object]) -> None:
    hot = tmp_path / "hot"
    plant_run_lock(hot, **fields)
    tier = Tier("hot", str(hot))
    assert runlock.live_runs(tier) == []  # ignored, never an exception
    manager = CheckpointManager(str(hot), staging=StagingOptions(async_save=False))
    manager.close()


def test_a_hostile_run_lock_planted_later_does_not_kill_the_heartbeat(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    tier = Tier("hot", str(hot))
    lock = runlock.acquire(tier, ttl=0.4)  # a beat every 0.1 s
    assert lock is not None and lock._thread is not None
    try:
        plant_run_lock(hot, pid=float("inf"))
        plant_run_lock(hot, pid=10**30, pid_space=runlock._pid_space())
        planted_at = lock.beat
        deadline = time.monotonic() + 20
        while lock.beat < planted_at + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock._thread.is_alive() and lock.beat >= planted_at + 5
        # Still beating: a beat of this run is in place (the newest, or the one before it
        # while the next is being published).
        assert list((hot / layout.run_lock_prefix(lock.info.run)).glob("*.json"))
    finally:
        lock.release()


# -- 2. a lease whose mtime lies far in the future ---------------------------------------------


def two_checkpoints(tmp_path: Path) -> tuple[str, Tier, str]:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        dcp.save({"w": torch.full((8, 8), float(step))}, storage_writer=TieredWriter(hot, step=step))
    return hot, Tier("hot", hot), layout.default_name(1)


def to_future(hot: str, key: str, seconds: float) -> None:
    then = time.time() + seconds
    os.utime(Path(hot, key), (then, then))


def test_a_lease_stamped_far_in_the_future_does_not_block_prune(tmp_path: Path) -> None:
    hot, tier, name = two_checkpoints(tmp_path)
    held = leases.take(tier, name, ttl=60.0)
    assert held is not None
    to_future(hot, held.key, YEAR)
    assert leases.live_leases(tier, name) == []  # no lease holds more than its ttl
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deleted == (name,) and report.deferred == ()
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()


def test_a_lease_stamped_far_in_the_future_does_not_block_gc(tmp_path: Path) -> None:
    hot, tier, name = two_checkpoints(tmp_path)
    held = leases.take(tier, name, ttl=60.0)
    assert held is not None
    [report] = prune(hot, hot_policy=keep_last(1))  # un-published; a live load keeps the data
    assert report.deferred == (name,)
    to_future(hot, held.key, YEAR)
    gc = collect_garbage(hot, grace=0, dry_run=False)
    assert (held.key, "expired lease") in [(g.key, g.reason) for g in gc.garbage]
    assert not Path(hot, layout.checkpoint_prefix(name)).exists()


def test_a_lease_a_little_ahead_still_protects_its_load(tmp_path: Path) -> None:
    hot, tier, name = two_checkpoints(tmp_path)
    held = leases.take(tier, name, ttl=600.0)
    assert held is not None
    to_future(hot, held.key, 30.0)  # a stamp some clock skew ahead: still an honest lease
    assert leases.live_leases(tier, name) == [held.key]
    [report] = prune(hot, hot_policy=keep_last(1))
    assert report.deferred == (name,)


# -- 3. a step no manifest can record ----------------------------------------------------------


def test_a_step_above_the_manifest_limit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from tierstore.format import manifest_format

    hot, limit = tmp_path / "hot", 1 << 62
    with pytest.raises(ConfigError, match=str(limit)):
        dcp.save(state_for(1), storage_writer=TieredWriter(str(hot), step=limit + 1))
    assert not [p for p in hot.rglob("*") if p.is_file()]
    TieredWriter(str(hot), step=limit)  # the limit itself is a step
    assert limit == manifest_format.MAX_STEP


# -- 4. a mistyped tier URL ----------------------------------------------------------------------


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


MISTYPED = [
    ("s3:/bucket/run", "s3://bucket/run"),
    ("s3:bucket/run", "s3://bucket/run"),
    ("GS:/bucket/run", "GS://bucket/run"),
    ("file:/data/run", "file:///data/run"),
    ("memory:/x", "memory://x"),
    ("fsspec+memory:/x", "fsspec+memory://x"),
    ("https:/host/x", "https://host/x"),
]


@pytest.mark.parametrize(("url", "meant"), MISTYPED)
def test_a_mistyped_url_is_refused_naming_what_was_meant(
    tmp_path: Path, cwd: Path, url: str, meant: str
) -> None:
    hot = str(tmp_path / "hot")
    for build in (
        lambda: CheckpointManager(hot, url, staging=StagingOptions(async_save=False)),
        lambda: TieredWriter(hot, url, step=1),
        lambda: TieredReader(hot, url),
        lambda: TieredWriter(url, step=1),
    ):
        with pytest.raises(ConfigError) as raised:
            build()
        assert url in str(raised.value) and meant in str(raised.value)
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("hot", ["s3:/bucket/run", "s3://bucket/run", "file:///data/run"])
def test_the_torch_checkpointing_hot_tier_is_a_local_directory(cwd: Path, hot: str) -> None:
    from tierstore.integrations.torch_checkpointing import TieredStorageConfig

    with pytest.raises(ConfigError, match="bucket/run|data/run"):
        TieredStorageConfig(hot=hot, run_id="outside").create_storage()
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("path", ["/data/run:1", "./a:b", "run:1", "a/s3:/b", "rel/dir", "~/x:y"])
def test_local_paths_with_a_colon_elsewhere_stay_local(cwd: Path, path: str) -> None:
    from tierstore.storage.registry import split_scheme

    assert split_scheme(path) == ("file", path)
    Tier("hot", path).check_scheme()
    assert list(cwd.iterdir()) == []


def test_the_cli_refuses_a_mistyped_cold_url_and_creates_nothing(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "hot"
    save(str(hot), 1)
    # migrate creates a missing cold tier: it must not create ./s3:/b/r
    assert main(["migrate", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    err = capsys.readouterr().err
    assert "s3:/b/r" in err and "s3://b/r" in err
    assert main(["ls", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    assert "s3:/b/r" in capsys.readouterr().err
    assert list(cwd.iterdir()) == []


def test_the_cli_ls_names_the_meant_url(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    assert main(["ls", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    assert "s3://b/r" in capsys.readouterr().err


# -- 5. SaveFailed through pickle --------------------------------------------------------------


class NeedsTwo(Exception):
    """Pickles, but cannot be unpickled (its __init__ wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def test_save_failed_keeps_step_and_errors_through_pickle() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    class Local(RuntimeError):  # a local class: pickle cannot find it
        pass

    exists = CheckpointExists("already committed", checkpoint="step-0000000007", tier="hot /x")
    failures = {0: exists, 1: (Local("lost"), None), 2: NeedsTwo("a", "b")}
    failure = save_failed(7, CheckpointException("save failed", failures))  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(failure))
    assert type(back) is SaveFailed and str(back) == str(failure)
    assert back.step == 7 and sorted(back.errors) == [0, 1, 2]
    assert type(back.errors[0]) is CheckpointExists and str(back.errors[0]) == str(exists)
    assert back.checkpoint == "step-0000000007" and back.tier == "hot /x"
    for rank, kind, text in ((1, "Local", "lost"), (2, "NeedsTwo", "a/b")):
        stand_in = back.errors[rank]
        assert isinstance(stand_in, TierstoreError)
        assert kind in str(stand_in) and text in str(stand_in)
    assert failure.errors[1].__class__ is Local  # in process the original errors stay


def test_a_real_failed_save_pickles_with_its_step_and_errors(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "hot"), staging=StagingOptions(async_save=False))
    assert manager.save(1, {"w": torch.zeros(4)})
    with pytest.raises(SaveFailed) as raised:
        manager.save(1, {"w": torch.zeros(4)}, force=True)
    manager.close()
    back = pickle.loads(pickle.dumps(raised.value))
    assert back.step == 1 and isinstance(back.errors[0], CheckpointExists)


# -- 6. the prune command shows its errors -------------------------------------------------------


def undeletable(hot: str, step: int) -> None:
    """A real undeletable file, root or not: a directory where the data file was."""
    data = file_path(hot, committed(hot, step))
    data.unlink()
    (data / "inside").mkdir(parents=True)


def test_the_prune_command_prints_errors_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2, 3):
        save(hot, step)
    undeletable(hot, 1)
    undeletable(hot, 2)
    code = main(["prune", "--hot", hot, "--hot-keep-last", "2", "--yes"])
    out = capsys.readouterr().out
    assert code == 1, out
    [line] = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert f"hot {hot}" in line and layout.default_name(1) in line
    assert main(["prune", "--hot", hot, "--hot-keep-last", "1", "--yes", "--json"]) == 1
    [report] = json.loads(capsys.readouterr().out)
    assert len(report["errors"]) == 1 and layout.default_name(2) in report["errors"][0]


def test_the_prune_command_prints_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    for step in (1, 2):
        save(hot, step, cold, migrated=True)
    Path(cold, layout.manifest_key(layout.default_name(1))).write_text("{torn")
    assert main(["prune", "--hot", hot, "--cold", cold, "--hot-keep-last", "1", "--yes"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert f"hot {hot}" in line and layout.default_name(1) in line and "invalid" in line


# -- 7. torch_checkpointing's streamed read falls back to cold -----------------------------------


def tc_storage(tmp_path: Path) -> object:
    from tierstore.integrations.torch_checkpointing import TieredStorageConfig

    return TieredStorageConfig(
        hot=str(tmp_path / "hot"), cold=str(tmp_path / "cold"), run_id="outside"
    ).create_storage()


def tc_committed(tmp_path: Path, data: bytes) -> tuple[object, Path]:
    """A checkpoint ``step_5`` of one file, committed in hot and migrated to cold."""
    from tierstore.migration import workers

    storage = tc_storage(tmp_path)
    hot = tmp_path / "hot"
    with storage.stream_write(hot / "tmp_step_5" / "model.pt") as out:  # type: ignore[attr-defined]
        out.write(data)
    storage.rename(hot / "tmp_step_5", hot / "step_5", is_directory=True)  # type: ignore[attr-defined]
    assert workers.drain(60)
    manifest = Tier("cold", str(tmp_path / "cold")).find_manifest("step_5")
    assert manifest is not None
    return storage, Path(hot, layout.file_key("step_5", manifest.attempt, "model.pt"))


def streamed(storage: object, path: Path) -> bytes:
    from torch_checkpointing.storage.base_storage import ReadArgs

    with storage.stream_read(path, ReadArgs(pre_read_full_file=False)) as stream:  # type: ignore[attr-defined]
        return bytes(stream.read())


def test_torch_checkpointing_streamed_read_falls_back_to_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = os.urandom(300_000)
    storage, hot_copy = tc_committed(tmp_path, data)
    damaged = bytearray(hot_copy.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    hot_copy.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING):
        assert streamed(storage, tmp_path / "hot" / "step_5" / "model.pt") == data
    assert "model.pt" in caplog.text
    hot_copy.unlink()  # missing in hot: cold again
    assert streamed(tc_storage(tmp_path), tmp_path / "hot" / "step_5" / "model.pt") == data


def test_torch_checkpointing_streamed_read_without_a_good_copy_names_file_and_tier(tmp_path: Path) -> None:
    from tierstore.errors import ChecksumMismatch

    storage, hot_copy = tc_committed(tmp_path, os.urandom(1000))
    cold_copy = tmp_path / "cold" / hot_copy.relative_to(tmp_path / "hot")
    for copy in (hot_copy, cold_copy):
        damaged = bytearray(copy.read_bytes())
        damaged[10] ^= 0x01
        copy.write_bytes(bytes(damaged))
    with pytest.raises(ChecksumMismatch) as raised:
        streamed(storage, tmp_path / "hot" / "step_5" / "model.pt")
    err = raised.value
    assert err.checkpoint == "step_5" and err.file == "model.pt" and err.tier is not None
    assert err.tier.startswith("cold")


# -- node-local, the cold tier down: every rank gets the same error; close(T) takes ~T ----------


@pytest.mark.dist
def test_a_node_local_resume_with_the_cold_tier_down_fails_alike_on_every_rank(tmp_path: Path) -> None:
    import socket

    from launch import run_job

    with socket.socket() as sock:  # a port nothing listens on: the cold tier is down
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager_cold_down",
        "hot": [str(tmp_path / f"node{r}") for r in (0, 1)],
        "cold": "s3://bucket/run",
        "endpoint": f"http://127.0.0.1:{port}",
        "out": str(out),
        "close_timeout": 10,
    }
    job = run_job(spec, 2, timeout=150)
    assert job.ok, job.describe()
    results = [json.loads((out / f"cold-down-rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["load"] for r in results} == {"TransientStorageError"}, results  # none hung
    for r in results:
        assert r["close"] == "MigrationFailed", results
        assert r["close_seconds"] < 10 + 10, results  # the deadline, not one per wait


@pytest.mark.dist
def test_a_node_local_runs_pending_checkpoints_are_finished_by_the_next_run(tmp_path: Path) -> None:
    from launch import run_job

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cold tier's directory should be")
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "op": "manager_node_local_resume",
        "hot": [str(tmp_path / f"node{r}") for r in (0, 1)],
        "blocker": str(blocker),
        "out": str(out),
    }
    job = run_job(spec, 2, timeout=150)
    assert job.ok, job.describe()
    results = [json.loads((out / f"node-local-resume-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["first"] == "MigrationFailed" for r in results), results
    assert all(r["cold"] == [1, 2] for r in results), results


def test_a_bad_writer_option_is_refused_when_the_manager_is_built(tmp_path: Path) -> None:
    from tierstore import CheckpointManager, WriterOptions
    from tierstore.errors import ConfigError

    with pytest.raises(TypeError, match="thread_cont"):
        WriterOptions(thread_cont=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="TIERSTORE_MAX_FILES_PER_DIR"):
        with pytest.MonkeyPatch.context() as env:  # what only a TieredWriter reads
            env.setenv("TIERSTORE_MAX_FILES_PER_DIR", "many")
            CheckpointManager(str(tmp_path / "hot"), writer=WriterOptions(thread_count=2))
    assert not (tmp_path / "hot" / "checkpoints").exists()


def test_the_manager_refuses_a_step_no_manifest_can_record_before_writing(tmp_path: Path) -> None:
    import torch

    from tierstore import CheckpointManager
    from tierstore.errors import ConfigError
    from tierstore.format.manifest_format import MAX_STEP

    with CheckpointManager(str(tmp_path / "hot"), retention=Retention(hot_min_free=None)) as manager:
        with pytest.raises(ConfigError, match="2\\*\\*62"):
            manager.save(MAX_STEP + 1, {"w": torch.zeros(4)})
        assert manager.health().saves_failed == 0  # refused, not a failed save
    assert not (tmp_path / "hot" / "checkpoints").exists()
