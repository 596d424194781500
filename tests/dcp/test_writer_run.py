"""What ``TieredWriter`` records of the run, the job and the state's structure (issue 25).

Proves, with real saves: ``run=`` is recorded (flat and two-level, and in the cold copy) and a
bad one is refused when the writer is built, naming it; the job id comes from torchrun's run
id, else the scheduler's job id (SLURM, PBS, LSF), is left out when there is none or it is no
label, and never fails a save; the fingerprint is the same for two saves of one structure
(other values, another encoding) and differs when a shape, a dtype or a key does, and it is
the fingerprint of the ``.metadata`` DCP wrote and of the state as a load planner holds it.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import blank, committed, file_path, save, state_for
from simulated_ranks import save_ranks
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tierstore import Store, TieredWriter, WriterOptions, _dist, list_checkpoints
from tierstore.dcp import structure
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.migration.migrator import MigrationOptions
from tierstore.tiers.tier import Tier

JOB_VARIABLES = [variable for variable, _ in _dist._JOB_VARIABLES]


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scheduler's id leaks in from the environment the tests run in."""
    for variable in JOB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def manifest_body(hot: str, step: int) -> dict[str, Any]:
    return json.loads(Path(hot, layout.manifest_key(layout.default_name(step))).read_text())


def test_run_is_recorded_and_listed(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1, run="ablation B")
    save(hot, 2)
    assert manifest_body(hot, 1)["run"] == "ablation B"
    assert "run" not in manifest_body(hot, 2) and "job" not in manifest_body(hot, 2)
    assert [(c.run, c.job) for c in list_checkpoints(hot)] == [("ablation B", None), (None, None)]


def test_run_job_and_fingerprint_reach_a_two_level_root_and_the_cold_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    store = Store(str(tmp_path / "hot"), str(tmp_path / "cold"))
    fast = MigrationOptions(chunk_size=4096, poll_interval=0.01, commit_timeout=10)
    manifest, writers = save_ranks(
        6, store, options=WriterOptions(manifest_part_ranks=2), run="A", migration=fast
    )
    assert writers[0].migrator is not None and writers[0].migrator.wait(30)
    assert manifest.version == 2
    for tier in store.tiers:
        read = tier.find_manifest(manifest.name)
        assert read is not None and (read.run, read.job) == ("A", "slurm job 4242")
        assert read.fingerprint == manifest.fingerprint is not None
    [info] = list_checkpoints(store)
    assert (info.tiers, info.run, info.job, info.fingerprint) == (
        ("hot", "cold"),
        "A",
        "slurm job 4242",
        manifest.fingerprint,
    )


@pytest.mark.parametrize(
    "run, named",
    [
        ("a/b", "run 'a/b'"),
        ("", "run ''"),
        ("x" * 129, "run 'x+\\.\\.\\."),
        ("tab\there", "run 'tab\\\\there'"),
        (" B", "run ' B'"),
        (7, "run 7"),
    ],
)
def test_a_bad_run_name_is_refused_when_the_writer_is_built(tmp_path: Path, run: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=f"TieredWriter: {named} is not a run name"):
        TieredWriter(str(tmp_path / "hot"), step=1, run=run)
    assert not (tmp_path / "hot" / "manifests").exists()


@pytest.mark.parametrize(
    "env, job",
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "5f3a", "SLURM_JOB_ID": "77"}, "torchrun run 5f3a"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "slurm job 77"),  # torchrun's default
        ({"TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": " 77 "}, "slurm job 77"),
        ({"PBS_JOBID": "1234.pbs01"}, "pbs job 1234.pbs01"),
        ({"LSB_JOBID": "99"}, "lsf job 99"),
        ({"SLURM_JOB_ID": "8", "PBS_JOBID": "9"}, "slurm job 8"),
    ],
)
def test_the_job_comes_from_the_launcher_or_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], job: str | None
) -> None:
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    assert _dist.job_id() == job
    hot = str(tmp_path / "hot")
    save(hot, 1)
    assert manifest_body(hot, 1).get("job") == job
    assert "run" not in manifest_body(hot, 1)  # derived, never a run name


@pytest.mark.parametrize("value", ["rdzv/with/slashes", "x" * 300, "bell\x07"])
def test_a_job_id_a_manifest_may_not_hold_is_left_out_and_the_save_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
    hot = str(tmp_path / "hot")
    with caplog.at_level(logging.DEBUG, logger="tierstore.dcp.writer"):
        save(hot, 1, run="A")
    body = manifest_body(hot, 1)
    assert "job" not in body and body["run"] == "A"
    assert any("not recording the job id" in r.getMessage() for r in caplog.records)


def _fingerprint(hot: str, step: int, state: dict[str, Any], **options: Any) -> str:
    dcp.save(state, storage_writer=TieredWriter(hot, step=step, **options))
    manifest = committed(hot, step)
    assert manifest.fingerprint is not None
    return manifest.fingerprint


def test_one_structure_has_one_fingerprint_and_any_change_another(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    first = _fingerprint(hot, 1, state_for(1))
    assert _fingerprint(hot, 2, state_for(2)) == first  # other values
    assert _fingerprint(hot, 3, state_for(3), options=WriterOptions(encoding="dcp")) == first
    wider = state_for(4, shape=(64, 34))
    assert _fingerprint(hot, 4, wider) != first  # a shape
    halved = {**state_for(5), "w": state_for(5)["w"].to(torch.float16)}
    assert _fingerprint(hot, 5, halved) != first  # a dtype
    more = {**state_for(6), "extra": {"step": 6, "note": "", "lr": 0.1}}
    assert _fingerprint(hot, 6, more) != first  # a key (an object's)
    renamed = {("v" if k == "w" else k): v for k, v in state_for(7).items()}
    assert _fingerprint(hot, 7, renamed) != first  # a name
    assert len({first, *(committed(hot, s).fingerprint for s in range(4, 8))}) == 5


def test_the_fingerprint_is_the_metadatas_and_the_loading_states(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    recorded = _fingerprint(hot, 1, state_for(1))
    metadata = pickle.loads(file_path(hot, committed(hot, 1), layout.METADATA_FILE).read_bytes())
    assert structure.of_metadata(metadata) == recorded
    planner = DefaultLoadPlanner()  # holds the state flattened, as DCP's planning does
    planner.set_up_planner(blank(), metadata, is_coordinator=True)
    assert structure.of_state(planner.state_dict) == recorded
    other = DefaultLoadPlanner()
    other.set_up_planner({**blank(), "w": torch.zeros(2)}, metadata, is_coordinator=True)
    assert structure.of_state(other.state_dict) != recorded


def test_an_old_manifest_without_them_lists_as_unknown(tmp_path: Path) -> None:
    golden = Path(__file__).parents[1] / "data" / "store-0.2"
    for info in list_checkpoints(str(golden)):
        assert (info.run, info.job, info.fingerprint) == (None, None, None)
    assert Tier("hot", str(golden)).manifests()  # there is something to list
