"""One rank of a resume test job: FSDP2 on CPU (gloo) with dropout, a seeded sampler, a scheduler.

Run by ``tests/launch.py`` with a JSON spec as argv[1]. Operations:

* ``train``: train ``steps`` steps from scratch; every ``save_every`` steps each entry of
  ``runs`` saves a ``TrainingState`` (leaving out that entry's ``exclude`` parts) into its own
  ``hot`` store. Rank 0 appends ``{"step", "loss"}`` to ``out/losses-train.jsonl`` after each
  step. ``kill_at: {"step": s, "rank": r}`` SIGKILLs rank r in the middle of step s (after
  backward, before the optimizer step), once its last save has committed, so the resume point
  does not depend on how fast the background flush was.
* ``resume``: for each entry of ``runs`` in turn, build everything afresh, load the newest
  checkpoint of its store (same ``exclude``; through ``ResumePlanner`` when ``planner`` is
  ``"resume"``), train to ``steps`` and write ``out/losses-resume-<tag>.jsonl`` (first line
  ``{"resumed_from": step}``) and the final data position to ``out/data-<tag>.json``.
* ``verify``: train 3 steps, save, ``manager.verify_resume`` with this file's :func:`probe`;
  once for a full state (``hot``) and once for a state without the optimizer (``hot_no_optim``);
  write both reports to ``out/verify-<tag>.json``; the first run also records the live state in
  ``out/record``.
* ``cadence``: a ``TimeCadence`` whose clock differs per rank; each rank writes its decisions to
  ``out/cadence-<rank>.json``.

Every per-step loss is the mean over ranks, written with ``repr`` (exact).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import shard_per_block
from torch import nn

from tierstore import (
    CheckpointManager,
    Probe,
    ResumableLoader,
    ResumableSampler,
    ResumePlanner,
    TrainingState,
)

warnings.filterwarnings("ignore")

VOCAB, SEQ, SAMPLES, BATCH = 64, 9, 80, 4


class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim),
                nn.Linear(dim, 2 * dim),
                nn.GELU(),
                nn.Dropout(0.2),
                nn.Linear(2 * dim, dim),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dataset() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)


def build(exclude: list[str] | tuple[str, ...] = ()) -> TrainingState:
    """Model, optimizer, scheduler and data position; the per-rank RNG stream starts seeded."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same init on every rank: fully_shard shards the full model
    model = Net()
    shard_per_block(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.5)
    loader = ResumableLoader(dataset(), BATCH, ResumableSampler(SAMPLES, seed=7))
    torch.manual_seed(1000 + rank)  # each rank's own stream (dropout)
    return TrainingState(model, optim, sched, sampler=loader, exclude=exclude)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.item() / dist.get_world_size())


def train(
    ts: TrainingState,
    managers: list[tuple[CheckpointManager, TrainingState]],
    steps: int,
    losses: Path,
    kill_at: dict[str, int] | None = None,
) -> None:
    assert isinstance(ts.sampler, ResumableLoader)
    batches = ts.sampler.endless()
    for step in range(ts.step + 1, steps + 1):
        tokens = next(batches)
        loss = loss_of(ts.model, tokens)
        loss.backward()
        if kill_at and kill_at["step"] == step and kill_at["rank"] == dist.get_rank():
            for manager, _ in managers:  # the last async save has committed: a fixed resume point
                manager.wait(migrations=False)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: gradients computed, not applied
        assert ts.optimizer is not None and ts.scheduler is not None
        ts.optimizer.step()
        ts.optimizer.zero_grad()
        ts.scheduler.step()  # type: ignore[attr-defined]
        value = mean_over_ranks(loss)
        if dist.get_rank() == 0:
            with losses.open("a") as f:
                f.write(json.dumps({"step": step, "loss": value}) + "\n")
        for manager, view in managers:
            view.step = step
            manager.save(step, {"train": view})


def views(ts: TrainingState, exclude: list[str]) -> TrainingState:
    """Another view of the same objects, leaving out ``exclude``."""
    return TrainingState(ts.model, ts.optimizer, ts.scheduler, ts.sampler, step=ts.step, exclude=exclude)


def op_train(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    ts = build()
    managers = [
        (CheckpointManager(run["hot"], save_every=spec["save_every"]), views(ts, run["exclude"]))
        for run in spec["runs"]
    ]
    train(ts, managers, spec["steps"], out / "losses-train.jsonl", spec.get("kill_at"))
    for manager, _ in managers:
        manager.close()


def op_resume(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    for run in spec["runs"]:
        ts = build(run["exclude"])
        manager = CheckpointManager(run["hot"], save_every=spec["save_every"])
        if spec.get("planner") == "resume":  # the world size may have grown
            start = manager.load({"train": ts}, planner=ResumePlanner())
        else:
            start = manager.load_latest({"train": ts})
        assert ts.step == (start or 0), (ts.step, start)
        losses = out / f"losses-resume-{run['tag']}.jsonl"
        if dist.get_rank() == 0:
            losses.write_text(json.dumps({"resumed_from": start}) + "\n")
        train(ts, [(manager, ts)], spec["steps"], losses)
        manager.close()
        if dist.get_rank() == 0:
            data = {
                k: v for k, v in ts.sampler.state_dict().items() if k in ("epoch", "position", "world_size")
            }
            (out / f"data-{run['tag']}.json").write_text(json.dumps(data))


def probe() -> Probe:
    """The verify_resume probe: this job's full training state and a fixed batch."""
    tokens = dataset()[:BATCH]

    def build_state() -> dict[str, Any]:
        return {"train": build()}

    def loss(state: dict[str, Any]) -> torch.Tensor:
        return loss_of(state["train"].model, tokens)  # train mode: dropout draws from the RNG

    return Probe(build=build_state, loss=loss)


def op_verify(spec: dict[str, Any]) -> None:
    out = Path(spec["out"])
    ts = build()
    cases = [("full", spec["hot"], []), ("no-optim", spec["hot_no_optim"], ["optim"])]
    managers = [(CheckpointManager(hot), views(ts, exclude)) for _, hot, exclude in cases]
    train(ts, [], 3, out / "losses-verify.jsonl")
    for (tag, _, _), (manager, view) in zip(cases, managers):
        view.step = 3
        manager.save(3, {"train": view})
        record = str(out / "record") if tag == "full" else None
        report = manager.verify_resume(f"{__file__}:probe", {"train": view}, record_dir=record)
        if dist.get_rank() == 0:
            body = {**report.to_dict(), "summary": report.summary()}
            (out / f"verify-{tag}.json").write_text(json.dumps(body, indent=1))
        manager.close()


def op_cadence(spec: dict[str, Any]) -> None:
    """TimeCadence with a different clock per rank: the ranks must still decide alike."""
    from tierstore.resume.cadence import TimeCadence

    rank = dist.get_rank()
    now = [0.0]
    cadence = TimeCadence(10.0, clock=lambda: now[0])
    decisions = []
    for t0, t1 in [(11.0, 5.0), (12.0, 11.0), (15.0, 15.0), (30.0, 31.0)]:
        now[0] = t0 if rank == 0 else t1
        decisions.append(cadence(len(decisions) + 1))
    (Path(spec["out"]) / f"cadence-{rank}.json").write_text(json.dumps(decisions))


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ops = {"train": op_train, "resume": op_resume, "verify": op_verify, "cadence": op_cadence}
    ops[spec["op"]](spec)
    from launch import leave_cleanly  # here: verify-resume also loads this file as a probe module

    leave_cleanly()


if __name__ == "__main__":
    main()
