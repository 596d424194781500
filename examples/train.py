"""Train a small transformer LM with FSDP2 on CPU, checkpointing through tierstore.

``python examples/train.py`` (what ``make demo`` runs) launches two ``torchrun`` jobs of 2
ranks each: the first trains and saves with ``dcp.async_save`` every few steps into the
tiered store; the second is a restart that resumes from the newest committed checkpoint
and trains on. It prints the checkpoints, their sizes and the training stall of each save.

``--worker`` runs one rank (torchrun starts those); see ``--help`` for the options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


# -- the rank side -----------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierstore import TieredReader, TieredWriter, latest_checkpoint

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
            att = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
            return x + self.mlp(self.norm2(x))

    class LM(nn.Module):
        def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 4, ctx: int = 64) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.02)
            self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(layers))
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = LM()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # async_save runs DCP's collectives in a background thread while training runs its own:
    # on one process group they would interleave differently on each rank and deadlock.
    # Checkpoint collectives get a group of their own.
    ckpt_group = dist.new_group(backend="gloo")

    corpus = torch.tensor(list(synthetic_corpus().encode()), dtype=torch.long)

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step * world + rank)
        starts = torch.randint(0, len(corpus) - 65, (8,), generator=g)
        return torch.stack([corpus[s : s + 65] for s in starts.tolist()])

    def emit(event: dict) -> None:
        if rank == 0:
            with open(args.events, "a") as log:
                log.write(json.dumps(event) + "\n")

    start = 0
    if args.resume:
        info = latest_checkpoint(args.hot)
        if info is not None:
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "progress": {"step": -1}}
            t0 = time.perf_counter()
            reader = TieredReader(args.hot)
            dcp.load(state, storage_reader=reader, process_group=ckpt_group)
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = state["progress"]["step"]
            emit({"event": "resumed", "step": start, "name": reader.manifest.name,
                  "seconds": time.perf_counter() - t0})

    pending = None
    for step in range(start + 1, args.steps + 1):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        emit({"event": "step", "step": step, "loss": loss.item()})
        if step % args.save_every == 0:
            if pending is not None:
                pending.result()  # block the next save only until the previous flush is done
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "progress": {"step": step}}
            t0 = time.perf_counter()
            pending = dcp.async_save(state, storage_writer=TieredWriter(args.hot, step=step),
                                     process_group=ckpt_group)
            emit({"event": "save", "step": step, "stall": time.perf_counter() - t0})
    if pending is not None:
        pending.result()
    dist.barrier()
    dist.destroy_process_group()


def synthetic_corpus(lines: int = 4000) -> str:
    """Deterministic text with learnable structure, generated, not downloaded."""
    import random

    rng = random.Random(1234)
    words = ["tier", "store", "shard", "rank", "save", "load", "hot", "cold", "disk", "bucket",
             "manifest", "commit", "step", "node", "crash", "resume", "flush", "verify"]
    out = []
    for i in range(lines):
        a, b, c = rng.choice(words), rng.choice(words), rng.choice(words)
        out.append(f"{i % 97:02d}: the {a} {b}s the {c}; {a} before {c}.")
    return "\n".join(out)


# -- the launcher side ---------------------------------------------------------------------


def launch(args: argparse.Namespace, *, steps: int, resume: bool) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), str(Path(__file__).resolve()), "--worker", "--hot", args.hot,
           "--steps", str(steps), "--save-every", str(args.save_every), "--events", args.events]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env)


def report(args: argparse.Namespace) -> None:
    from tierstore import list_checkpoints

    events = [json.loads(line) for line in Path(args.events).read_text().splitlines()]
    saves = {e["step"]: e["stall"] for e in events if e["event"] == "save"}
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    print(f"\nloss: step 1 {losses[min(losses)]:.3f} -> step {max(losses)} {losses[max(losses)]:.3f}")
    for e in events:
        if e["event"] == "resumed":
            print(f"restart resumed from {e['name']} (step {e['step']}) in {e['seconds']:.2f} s")
    print(f"\ncheckpoints in hot tier {args.hot}:")
    print(f"  {'name':<18}{'step':>6}{'size':>12}{'files':>7}  {'tiers':<10}{'save stall':>11}")
    for c in list_checkpoints(args.hot):
        stall = f"{saves[c.step] * 1000:.0f} ms" if c.step in saves else "-"
        print(f"  {c.name:<18}{c.step:>6}{c.size / 2**20:>9.1f} MiB{c.num_files:>7}  "
              f"{','.join(c.tiers):<10}{stall:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot", default=str(Path.cwd() / "demo-run" / "hot"), help="hot tier path or URL")
    parser.add_argument("--steps", type=int, default=40, help="total training steps")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint cadence in steps")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job")
    parser.add_argument("--events", default=None, help="event log (JSON lines)")
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    run_dir = Path(args.hot).parent
    if run_dir.name == "demo-run" and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # the demo starts clean; a --hot you chose is never deleted
    run_dir.mkdir(parents=True, exist_ok=True)
    args.events = args.events or str(run_dir / "events.jsonl")
    first = args.steps * 3 // 5
    print(f"== job 1: train steps 1-{first}, async_save every {args.save_every} steps into {args.hot}")
    launch(args, steps=first, resume=False)
    print(f"== job 2: restart, resume from the newest committed checkpoint, train to step {args.steps}")
    launch(args, steps=args.steps, resume=True)
    report(args)


if __name__ == "__main__":
    main()
