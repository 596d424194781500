"""Train a small transformer LM with FSDP2 on CPU, kill it, resume it, and prove nothing changed.

``python examples/train.py`` (what ``make demo`` runs) launches two ``torchrun`` jobs of 2 ranks:

1. the **reference**: the run, uninterrupted and without checkpoints;
2. the **interrupted** run: the same, saving its whole training state (model, optimizer, LR
   scheduler, step, per-rank RNG, data position) with ``dcp.async_save`` every few steps through
   a ``CheckpointManager`` into a hot tier (``./demo-run/hot``) that migrates to a cold tier
   (``./demo-run/cold``, or ``--cold s3://...`` / ``gs://...``). At ``--kill-at`` rank 1 SIGKILLs
   itself mid-step; torchrun restarts the job, which resumes from the newest committed
   checkpoint, finishes, and runs ``verify_resume`` on its last checkpoint.

It then prints both loss curves side by side, whether they are identical, the training stall of
every save, the checkpoint cadence those stalls call for on a large job, and where the
checkpoints are. ``--worker`` runs one rank (torchrun starts those); see ``--help``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tierstore import (
    CheckpointManager,
    Probe,
    ResumableLoader,
    ResumableSampler,
    Store,
    TrainingState,
    list_checkpoints,
)
from tierstore.resume.cadence import optimal_interval

CTX, VOCAB, BATCH = 32, 256, 8


# -- the model and the data (the verify_resume probe builds them too) -------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        # Dropout draws from each rank's RNG: a resume without the RNG state would diverge.
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(CTX, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def synthetic_corpus(lines: int = 2000) -> str:
    """Deterministic text with learnable structure, generated, not downloaded."""
    import random

    rng = random.Random(1234)
    words = [
        "tier",
        "store",
        "shard",
        "rank",
        "save",
        "load",
        "hot",
        "cold",
        "disk",
        "bucket",
        "manifest",
        "commit",
        "step",
        "node",
        "crash",
        "resume",
        "flush",
        "verify",
    ]
    out = []
    for i in range(lines):
        a, b, c = rng.choice(words), rng.choice(words), rng.choice(words)
        out.append(f"{i % 97:02d}: the {a} {b}s the {c}; {a} before {c}.")
    return "\n".join(out)


def samples() -> torch.Tensor:
    """The dataset: windows of CTX + 1 bytes of the corpus, one row per sample."""
    corpus = torch.tensor(list(synthetic_corpus().encode()), dtype=torch.long)
    starts = range(0, len(corpus) - CTX - 1, 3 * CTX)
    return torch.stack([corpus[s : s + CTX + 1] for s in starts])


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def build(steps: int = 40) -> TrainingState:
    """Everything one rank trains with, as one DCP Stateful."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same init on every rank: fully_shard shards the full model
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=steps, eta_min=3e-4)
    data = samples()
    loader = ResumableLoader(data, BATCH, ResumableSampler(len(data), seed=1234))
    torch.manual_seed(1000 + rank)  # each rank's own random stream from here on
    return TrainingState(model, optim, sched, sampler=loader, seed=1234)


def probe() -> Probe:
    """For verify_resume: fresh objects to load into, and the loss on one fixed batch."""
    batch = samples()[:BATCH]
    return Probe(build=lambda: {"train": build()}, loss=lambda state: loss_fn(state["train"].model, batch))


# -- one rank ---------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def emit(event: dict[str, Any], every_rank: bool = False) -> None:
        if rank == 0 or every_rank:
            with open(args.events, "a") as log:
                log.write(json.dumps({**event, "attempt": attempt}) + "\n")

    train = build(args.steps)
    state = {"train": train}
    manager = None
    if args.save_every:
        # async_save runs DCP collectives in a background thread; the manager gives them a
        # process group of their own so they never interleave with training's.
        manager = CheckpointManager(args.hot, args.cold, save_every=args.save_every)
        started = time.perf_counter()
        if manager.load_latest(state) is not None:
            emit({"event": "resumed", "step": train.step, "seconds": time.perf_counter() - started})

    assert isinstance(train.sampler, ResumableLoader) and train.optimizer and train.scheduler
    batches = train.sampler.endless()
    for step in range(train.step + 1, args.steps + 1):
        loss = loss_fn(train.model, next(batches))
        loss.backward()
        if step == args.kill_at and rank == world - 1 and attempt == 0:
            emit({"event": "killed", "step": step, "rank": rank}, every_rank=True)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: gradients computed, not yet applied
        train.optimizer.step()
        train.optimizer.zero_grad()
        train.scheduler.step()
        train.step = step
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        emit({"event": "step", "step": step, "loss": mean.item() / world})
        if manager is not None and manager.save(step, state, force=step == args.steps):
            emit({"event": "save", "step": step, "stall": manager.stalls[step]})

    if manager is not None:
        if args.verify:
            report = manager.verify_resume(probe, state)  # right after the last save
            emit({"event": "verify", "ok": report.ok, "summary": report.summary()})
        manager.close()
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    del train, state, manager, batches
    gc.collect()  # FSDP2 modules sit in reference cycles that would hold the groups into exit
    dist.destroy_process_group()


# -- the launcher -------------------------------------------------------------------------------


def torchrun(args: argparse.Namespace, *, events: Path, checkpoints: bool) -> int:
    """Run one 2-rank job; torchrun's own messages go to a log next to the events."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "--max-restarts",
        "1" if checkpoints else "0",
        "--monitor-interval",
        "0.2",
        str(Path(__file__).resolve()),
        "--worker",
        "--steps",
        str(args.steps),
        "--events",
        str(events),
    ]
    if checkpoints:
        cmd += ["--hot", args.hot, "--save-every", str(args.save_every), "--kill-at", str(args.kill_at)]
        cmd += ["--cold", args.cold] if args.cold else []
        cmd += [] if args.verify else ["--no-verify"]
    else:
        cmd += ["--save-every", "0", "--kill-at", "0"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "LOGLEVEL": "ERROR",
        # torchrun shares its rendezvous store with the workers; after a restart, groups made
        # with new_group (the manager's checkpoint group) would read the dead attempt's
        # addresses from it and fail to connect (pytorch/pytorch#135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    log = events.with_suffix(".torchrun.log")
    with log.open("w") as stderr:
        code = subprocess.run(cmd, env=env, stderr=stderr).returncode
    for line in log.read_text().splitlines():
        if "exitcode" in line:  # torchrun saw a worker die: show that much of its log here
            print("   torchrun: " + line[line.index("failed") :] if "failed" in line else line)
    if code != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
    return code


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def report(args: argparse.Namespace, reference: Path, interrupted: Path) -> bool:
    """Print the curves side by side, the stalls, the verification and the checkpoints."""
    events = read_events(interrupted)
    identical = print_curves(read_events(reference), events)
    print_stalls(events)
    for e in events:
        if e["event"] == "verify":
            print("\n" + e["summary"])
    print("\ncheckpoints (retention keeps the last 2 in hot, the last 3 in cold):")
    where = {"hot": args.hot, "cold": args.cold}
    for info in list_checkpoints(Store.of(args.hot, args.cold)):
        paths = "  ".join(f"{t}: {where[t]}" for t in info.tiers)
        print(f"  {info.name}  step {info.step:>3}  {info.size / 2**20:5.1f} MiB  {paths}")
    return identical


def print_curves(reference: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
    ref = {e["step"]: e["loss"] for e in reference if e["event"] == "step"}
    resumed: dict[int, float] = {}
    replayed: dict[int, float] = {}  # steps the restart trained again: the first attempt's losses
    for e in events:
        if e["event"] == "step":
            if e["step"] in resumed:
                replayed[e["step"]] = resumed[e["step"]]
            resumed[e["step"]] = e["loss"]
    killed = next((e for e in events if e["event"] == "killed"), None)
    restart = next((e for e in events if e["event"] == "resumed"), None)
    print(f"\n{'step':>5}  {'uninterrupted':>16}  {'interrupted+resumed':>20}")
    first = restart["step"] + 1 if restart else None
    for step in sorted(ref):
        mark = f"  <- resumed here from step {restart['step']}" if restart and step == first else ""
        if killed and step == killed["step"]:
            mark += f"  (rank {killed['rank']} was SIGKILLed in this step the first time)"
        got = f"{resumed[step]:.7f}" if step in resumed else "-"
        print(f"{step:>5}  {ref[step]:>16.7f}  {got:>20}{mark}")
    identical = resumed == ref and all(ref[s] == v for s, v in replayed.items())
    twice = f"; steps {min(replayed)}-{max(replayed)} were trained twice, identically" if replayed else ""
    same = sum(ref.get(s) == v for s, v in resumed.items())
    print(f"\nidentical: {'yes' if identical else 'NO'} ({same}/{len(ref)} steps bit-identical{twice})")
    if killed:
        how = f", which resumed from step {restart['step']} in {restart['seconds']:.2f} s" if restart else ""
        print(
            f"rank {killed['rank']} was SIGKILLed mid-step {killed['step']}; torchrun restarted the job{how}"
        )
    return identical


def print_stalls(events: list[dict[str, Any]]) -> None:
    stalls = {e["step"]: e["stall"] for e in events if e["event"] == "save"}
    print("\nsave stalls (dcp.async_save through CheckpointManager, training blocked):")
    print("  " + ", ".join(f"step {s}: {v * 1000:.0f} ms" for s, v in sorted(stalls.items())))
    if stalls:
        plan = optimal_interval(nodes=64, mtbf_node=30 * 86400, stall=max(stalls.values()))
        print(
            "  cadence (tierstore.resume.cadence): with this stall, a 64-node job whose nodes fail every "
            f"30 days on average should\n    {plan.describe()}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default=str(Path.cwd() / "demo-run"), help="where the demo writes")
    parser.add_argument("--hot", help="hot tier path or URL (default: WORKDIR/hot)")
    parser.add_argument("--cold", help="cold tier path or URL, e.g. s3://bucket/run (default: WORKDIR/cold)")
    parser.add_argument("--steps", type=int, default=40, help="total training steps")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint cadence in steps (0: never)")
    parser.add_argument("--kill-at", type=int, default=25, help="SIGKILL a rank in the middle of this step")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip verify_resume")
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    workdir = Path(args.workdir)
    if workdir.name == "demo-run" and workdir.exists():
        shutil.rmtree(workdir)  # the demo starts clean; a --workdir of your own is never deleted
    workdir.mkdir(parents=True, exist_ok=True)
    args.hot = args.hot or str(workdir / "hot")
    args.cold = args.cold or str(workdir / "cold")
    reference, interrupted = workdir / "reference.jsonl", workdir / "interrupted.jsonl"

    started = time.monotonic()
    print(f"== reference: {args.nproc} ranks, FSDP2 on CPU, {args.steps} steps, no checkpoints", flush=True)
    if torchrun(args, events=reference, checkpoints=False) != 0:
        raise SystemExit("the reference run failed")
    print(
        f"== interrupted: the same run, async_save every {args.save_every} steps into hot {args.hot} "
        f"(migrating to cold {args.cold}); a rank is SIGKILLed at step {args.kill_at}, torchrun restarts "
        "the job and it resumes",
        flush=True,
    )
    if torchrun(args, events=interrupted, checkpoints=True) != 0:
        raise SystemExit("the interrupted run failed even after its restart")
    identical = report(args, reference, interrupted)
    print(f"\ndemo finished in {time.monotonic() - started:.0f} s; events in {workdir}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
