"""verify_resume: fresh processes load a checkpoint and are compared with the run that saved it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import run_job

from tierstore.errors import ConfigError
from tierstore.resume.check import Probe, load_probe, probe_spec
from tierstore.resume.report import compare, part_of

JOB = Path(__file__).parents[1] / "resume_job.py"


def live(loss: float, **digests: str) -> dict[str, object]:
    return {"loss": loss, "digests": digests}


def test_part_of_names_the_part_of_the_training_state() -> None:
    assert part_of("train.optim.state.w.exp_avg") == "optimizer"
    assert part_of("train.model.blocks.0.weight") == "model"
    assert part_of("train.rng.rank1.torch") == "rng"
    assert part_of("train.data.position") == "data"
    assert part_of("train.scheduler.last_epoch") == "scheduler"
    assert part_of("train.step") == "step"
    assert part_of("weights") == "other"


def test_a_checkpoint_without_optimizer_state_fails_naming_it() -> None:
    before = live(2.5, **{"t.model.w": "a", "t.optim.state.w.exp_avg": "b", "t.step": "3"})
    after = {
        "loss": 2.5,
        "missing": ["t.optim.state.w.exp_avg"],
        "digests": {"t.model.w": "a", "t.optim.state.w.exp_avg": "zeros", "t.step": "3"},
    }
    report = compare("step-3", [before, before], [after, after])
    assert not report.ok and report.loss_ok
    assert report.parts_failed() == ["optimizer"]
    assert [(m.key, m.problem, m.ranks) for m in report.mismatches] == [
        ("t.optim.state.w.exp_avg", "missing from the checkpoint", (0, 1))
    ]
    text = report.summary()
    assert "FAILED" in text and "optimizer: 1 key(s) missing from the checkpoint" in text
    assert "t.optim.state.w.exp_avg" in text


def test_losses_are_bit_exact_by_default_with_a_tolerance_option() -> None:
    before, after = live(1.0, k="x"), {"loss": 1.0 + 1e-7, "digests": {"k": "x"}}
    assert not compare("c", [before], [after]).ok
    assert "DIFFERENT" in compare("c", [before], [after]).summary()
    assert compare("c", [before], [after], rtol=1e-5).ok


def test_differing_keys_and_fresh_process_errors_are_reported() -> None:
    before = live(1.0, **{"t.rng.rank0.torch": "s1", "t.data.position": "8"})
    after = {"loss": 1.0, "digests": {"t.rng.rank0.torch": "s2", "t.data.position": "8"}}
    report = compare("c", [before, before], [after, {"error": "CheckpointException: boom"}])
    assert report.parts_failed() == ["rng"] and not report.ok
    assert any("rank 1 fresh process: CheckpointException: boom" in e for e in report.errors)


def test_without_a_live_record_only_completeness_is_checked() -> None:
    report = compare("c", [None], [{"loss": 3.0, "digests": {"k": "x"}, "missing": []}])
    assert report.ok and not report.compared_live and "no live record" in report.summary()


def test_probe_specs_name_importable_functions(tmp_path: Path) -> None:
    script = tmp_path / "my_probe.py"
    script.write_text(
        "from tierstore.resume.check import Probe\n"
        "def probe():\n    return Probe(build=dict, loss=lambda s: 1.5)\n"
        "if __name__ == '__main__':\n    raise SystemExit('must not run')\n"
    )
    factory = load_probe(f"{script}:probe")
    made = factory()
    assert isinstance(made, Probe) and made.loss({}) == 1.5
    assert probe_spec(load_probe) == "tierstore.resume.probes:load_probe"
    with pytest.raises(ConfigError):
        probe_spec(lambda: made)
    with pytest.raises(ConfigError):
        load_probe("no-colon")


@pytest.mark.dist
def test_verify_resume_passes_a_full_checkpoint_and_fails_one_without_optimizer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    full, no_optim = tmp_path / "full", tmp_path / "no-optim"
    spec = {"op": "verify", "hot": str(full), "hot_no_optim": str(no_optim), "out": str(out)}
    job = run_job(spec, 2, script=JOB, timeout=300)
    assert job.ok, job.describe()

    good = json.loads((out / "verify-full.json").read_text())
    assert good["ok"], good["summary"]
    assert good["loss_before"] == good["loss_after"] and None not in good["loss_before"]
    assert good["keys_checked"] > 50 and good["mismatches"] == []

    bad = json.loads((out / "verify-no-optim.json").read_text())
    assert not bad["ok"] and bad["parts_failed"] == ["optimizer"], bad["summary"]
    assert all(
        m["problem"] == "missing from the checkpoint" and m["key"].startswith("train.optim.")
        for m in bad["mismatches"]
    )
    assert "optimizer:" in bad["summary"] and "missing from the checkpoint" in bad["summary"]

    # The command line: against the live record the run wrote, and with no record at all.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    probe = f"{JOB}:probe"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore",
            "verify-resume",
            "--hot",
            str(full),
            "--probe",
            probe,
            "--record",
            str(out / "record"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step-0000000003 on 2 rank(s): OK" in proc.stdout and "identical" in proc.stdout
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore",
            "verify-resume",
            "--hot",
            str(no_optim),
            "--probe",
            probe,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    body = json.loads(proc.stdout)
    assert body["parts_failed"] == ["optimizer"] and not body["compared_live"]


def test_the_command_starts_without_importing_torch() -> None:
    code = (
        "import sys, tierstore, tierstore.cli, tierstore.resume.check, tierstore.resume.cadence, tierstore.resume.data; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    help_text = subprocess.run(
        [sys.executable, "-m", "tierstore", "verify-resume", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_text.returncode == 0 and "--probe" in help_text.stdout


PROBE_MODULE = """
import torch
from torch import nn
from tierstore import Probe, TrainingState

def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    return {"train": TrainingState(model, torch.optim.Adam(model.parameters(), lr=0.1))}

def probe():
    batch = torch.ones(3, 4)
    return Probe(build=build, loss=lambda state: state["train"].model(batch).sum())
"""


def test_verify_resume_in_one_process_without_torch_distributed(tmp_path: Path) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from tierstore import CheckpointNotFound, TieredWriter, verify_resume

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    (tmp_path / "single_probe.py").write_text(PROBE_MODULE)
    spec = f"{tmp_path / 'single_probe.py'}:probe"
    with pytest.raises(CheckpointNotFound):
        verify_resume(spec, {}, store=str(tmp_path / "empty"))
    state = load_probe(spec)().build()
    model, optim = state["train"].model, state["train"].optimizer
    model(torch.ones(3, 4)).sum().backward()
    optim.step()
    dcp.save(state, storage_writer=TieredWriter(str(tmp_path / "hot"), step=1))
    report = verify_resume(spec, state, store=str(tmp_path / "hot"), timeout=120)
    assert report.ok, report.summary()
    assert report.world_size == 1 and report.loss_before == report.loss_after
