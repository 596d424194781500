"""SIGTERM to a Lightning job under Lightning's own launcher (issue 35, item 4): real processes.

Run as a script, this file is the user's ``python train.py`` (``devices=2`` on CPU, gloo,
``ModelParallelStrategy`` with FSDP2 ``fully_shard``, ``TierstoreCheckpoint`` saving at every
epoch end): started once by the test, it is rank 0, and Lightning's launcher starts rank 1 by
running it again. The test signals the ranks as a scheduler would (every rank, as a Slurm
batch step without srun does; one rank; every rank twice) and asserts that both processes
are gone within the manager's grace period, with the step they stopped at committed in the
hot and the cold tier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch

from tierstore import Store, list_checkpoints

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/: launch.py
from launch import free_port  # noqa: E402

pytestmark = pytest.mark.dist

GRACE = 10.0  # seconds: PreemptionOptions(grace_seconds=GRACE), the bound on signal-to-exit
STEPS_PER_EPOCH = 4


def _job(spec: dict[str, Any]) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.distributed.fsdp import fully_shard

    from tierstore import PreemptionOptions
    from tierstore.integrations.lightning import TierstoreCheckpoint

    out = Path(spec["out"])

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def configure_model(self) -> None:
            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def on_train_start(self) -> None:
            (out / f"pid-{self.global_rank}").write_text(str(os.getpid()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # Ranks out of step, as real ones are: the signal finds them at different points.
            time.sleep(spec["step_seconds"] * (1 + self.global_rank))
            (out / f"step-{self.global_rank}.tmp").write_text(str(self.global_step))
            os.replace(out / f"step-{self.global_rank}.tmp", out / f"step-{self.global_rank}")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    data = torch.Generator().manual_seed(1)
    n = 4 * STEPS_PER_EPOCH
    dataset = torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=data), torch.randn(n, 1, generator=data)
    )
    checkpoint = TierstoreCheckpoint(
        spec["hot"],
        spec["cold"],
        every_n_epochs=1,
        save_on_train_epoch_end=True,
        manager_options={"preemption": PreemptionOptions(grace_seconds=GRACE)},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1000,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    try:
        trainer.fit(Net(), torch.utils.data.DataLoader(dataset, batch_size=4))
    except SIGTERMException:  # what Lightning raises on a SIGTERM; the script ends with it (exit 0)
        (out / f"preempted-{trainer.global_rank}.json").write_text(json.dumps({"step": trainer.global_step}))
        raise


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs still (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(predicate: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s:\n{log.read_text()[-6000:]}")
        time.sleep(0.02)


@dataclass
class Job:
    out: Path
    took: float  # seconds from the first signal to the last process's exit
    returncode: int  # of the process the test started: rank 0, or torchrun's agent
    output: str  # every process's


Send = list[
    tuple[float, tuple[str, ...]]
]  # (seconds to wait first, whom to signal: "rank0", "rank1", "agent")


def _train_and_signal(tmp_path: Path, send: Send, *, torchrun: bool = False) -> Job:
    """Start ``python train.py`` (rank 0; Lightning's launcher starts rank 1), or
    ``torchrun --nproc-per-node=2 train.py`` (its agent starts both ranks); once both ranks
    train, send SIGTERM per ``send``; wait for every process to end."""
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "out": str(out),
        "hot": str(tmp_path / "hot"),
        "cold": str(tmp_path / "cold"),
        "step_seconds": 0.03,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(
        PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", MASTER_PORT=str(free_port())
    )
    script = [str(Path(__file__).resolve()), json.dumps(spec)]
    if torchrun:
        script = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *script]
    log = out / "output.txt"
    with log.open("wb") as output:
        started = subprocess.Popen(
            [sys.executable, *script],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the ranks, its children, join this session: one killpg ends all
        )
    try:
        # Past the first epoch's checkpoint (step 4), in the middle of training.
        _wait_for(
            lambda: all(
                (out / f"step-{r}").exists() and int((out / f"step-{r}").read_text() or 0) >= 6
                for r in (0, 1)
            ),
            120,
            "both ranks training past step 6",
            log,
        )
        pids = {f"rank{r}": int((out / f"pid-{r}").read_text()) for r in (0, 1)}
        pids["agent"] = started.pid
        first = time.monotonic()
        for delay, whom in send:
            time.sleep(delay)
            for name in whom:
                os.kill(pids[name], signal.SIGTERM)
        while any(_alive(p) for p in pids.values()) and time.monotonic() < first + GRACE + 5:
            started.poll()
            time.sleep(0.02)
        took = time.monotonic() - first
        alive = [name for name, pid in pids.items() if _alive(pid)]
        for name in alive:  # PYTHONFAULTHANDLER: each thread's stack into the output, then it ends
            os.kill(pids[name], signal.SIGABRT)
        if alive:
            time.sleep(1.0)
        assert not alive, f"{alive} still running {took:.1f}s after the signal:\n{log.read_text()[-8000:]}"
        returncode = started.wait(5)
    finally:
        if started.poll() is None:
            os.killpg(started.pid, signal.SIGKILL)
            started.wait()
    return Job(out, took, returncode, log.read_text())


def _assert_preemption_checkpoint_in_both_tiers(tmp_path: Path, job: Job) -> int:
    """Both ranks stopped at one step, and that step is the newest checkpoint of both tiers."""
    stopped = [json.loads((job.out / f"preempted-{r}.json").read_text())["step"] for r in (0, 1)]
    assert stopped[0] == stopped[1], (stopped, job.output[-6000:])
    step = stopped[0]
    assert f"saved step {step} " in job.output and "committed in the cold tier" in job.output, job.output[
        -6000:
    ]
    assert list_checkpoints(str(tmp_path / "hot"))[-1].step == step
    assert list_checkpoints(Store(cold=str(tmp_path / "cold")))[-1].step == step
    return step


@pytest.mark.parametrize(
    "send",
    [
        pytest.param([(0.0, ("rank0", "rank1"))], id="every_rank"),  # rank 1 gets two: ours, rank 0's forward
        pytest.param([(0.0, ("rank1",))], id="rank_1_only"),  # rank 0 hears of it from rank 1 alone
    ],
)
def test_sigterm_under_lightnings_launcher_ends_both_ranks_within_the_grace_period_with_the_step_in_both_tiers(
    tmp_path: Path, send: Send
) -> None:
    job = _train_and_signal(tmp_path, send)
    assert job.returncode == 0, job.output[-8000:]  # SIGTERMException through the script's end
    _assert_preemption_checkpoint_in_both_tiers(tmp_path, job)
    assert job.took < GRACE, f"{job.took:.1f}s from the signal to the last exit"
    print(f"signal to exit: {job.took:.2f}s (grace {GRACE:g}s)")


def test_a_second_sigterm_to_every_rank_changes_nothing_before_the_checkpoint_is_in_both_tiers(
    tmp_path: Path,
) -> None:
    job = _train_and_signal(tmp_path, [(0.0, ("rank0", "rank1")), (0.05, ("rank0", "rank1"))])
    _assert_preemption_checkpoint_in_both_tiers(tmp_path, job)
    # One that comes after the manager closed ends the process at once, as it was ending anyway
    # (the signal's default action, docs/training-state.md).
    assert job.returncode in (0, -signal.SIGTERM), job.output[-8000:]
    assert job.took < GRACE, f"{job.took:.1f}s from the signal to the last exit"
    print(f"signal to exit: {job.took:.2f}s (grace {GRACE:g}s)")


def test_sigterm_to_torchruns_agent_ends_both_ranks_within_the_grace_period_with_the_step_in_both_tiers(
    tmp_path: Path,
) -> None:
    # The agent sends SIGTERM to every worker and SIGKILLs them 30 s later.
    job = _train_and_signal(tmp_path, [(0.0, ("agent",))], torchrun=True)
    _assert_preemption_checkpoint_in_both_tiers(tmp_path, job)
    assert job.took < GRACE, f"{job.took:.1f}s from the signal to the last exit"
    print(f"signal to exit: {job.took:.2f}s (grace {GRACE:g}s)")


_SLURM = {  # one task of a Slurm step, as srun sets it
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "1234",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "127.0.0.1",
}


def _fit_under_slurm(tmp_path: Path, preemption: Any) -> list[Any]:
    """A 2-step fit in this process under Lightning's SLURMEnvironment (auto-requeue on);
    the SIGUSR1 handler seen during training."""
    import lightning as L
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

    from tierstore.integrations.lightning import TierstoreCheckpoint

    seen: list[Any] = []

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(signal.getsignal(signal.SIGUSR1))
            loss: torch.Tensor = self.layer(batch[0]).sum()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        plugins=[SLURMEnvironment()],
        callbacks=[TierstoreCheckpoint(str(tmp_path / "hot"), manager_options={"preemption": preemption})],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2))))
    return seen


def test_slurms_requeue_handler_which_saves_inside_the_signal_handler_is_named_or_kept_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore import PreemptionOptions

    for name, value in _SLURM.items():
        monkeypatch.setenv(name, value)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.warns(
        UserWarning, match=r"auto-requeue saves its own checkpoint from inside the SIGUSR1 handler"
    ):
        seen = _fit_under_slurm(tmp_path / "default", PreemptionOptions())
    assert seen and all(h not in (before, signal.SIG_DFL) for h in seen)  # Lightning's, installed
    # The manager watching SIGUSR1 holds the signal first: Lightning does not install its
    # handler, and a SIGUSR1 is a preemption notice like SIGTERM.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*auto-requeue.*")
        seen = _fit_under_slurm(
            tmp_path / "watched", PreemptionOptions(signals=(signal.SIGTERM, signal.SIGUSR1))
        )
    assert seen and all(
        getattr(getattr(h, "__func__", None), "__qualname__", "") == "SignalWatch._handle" for h in seen
    ), seen
    assert signal.getsignal(signal.SIGUSR1) == before


def test_with_preemption_off_lightnings_own_handler_stays_and_a_multi_rank_trainer_is_told(
    tmp_path: Path,
) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from tierstore.integrations._lightning_sigterm import SigtermTakeover

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"))
    with pytest.warns(UserWarning, match="leaves Lightning's own SIGTERM handler in place"):
        SigtermTakeover().install(trainer, None)
    assert "_sigterm_notifier_fn" not in vars(trainer._signal_connector)


if __name__ == "__main__":
    _job(json.loads(sys.argv[1]))
