"""One rank of a test job: FSDP2 on CPU (gloo), saving and loading through tierstore.

Run by ``tests/launch.py`` with a JSON spec as argv[1]. Operations:

* ``train_save``: build the model, then for each entry of ``saves`` train ``train_steps``
  steps and save with that entry's ``mode`` (sync | thread | process) as ``step``;
  write the full-state digest of what was saved to ``out/saved-<step>.json``.
  With ``cold`` and ``drain``, wait for every migration and write ``out/migration.json``.
* ``load``: for each entry of ``loads`` build a fresh model (different init), load it
  through ``TieredReader`` and write the digest of the loaded state to
  ``out/loaded-<tag>.json`` (rank 0), plus ``reader.manifest.name``.
* ``manager_*``: a ``CheckpointManager`` scenario each (see its docstring).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import shard_per_block
from launch import leave_cleanly
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierstore import Retention, Store, TieredReader, TieredWriter
from tierstore.migration.status import wait_for_migrations

warnings.filterwarnings("ignore")


class Net(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    shard_per_block(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, start: int) -> None:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 96, (4, 16), generator=g)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every full (unsharded) tensor of model and optimizer state."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            t = obj.detach().reshape(-1).contiguous().cpu()
            out[prefix] = (
                f"{t.dtype}{tuple(obj.shape)}:"
                + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
            )
        else:
            out[prefix] = repr(obj)

    walk("model", msd)
    walk("optim", osd)
    return out


def tiers(spec: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    hot = spec["hot"]
    if isinstance(hot, list):  # node-local: one hot root per rank
        hot = hot[rank]
    return {"hot": hot, "cold": spec.get("cold")}


def train_save(spec: dict[str, Any]) -> None:
    world = dist.get_world_size()
    model, optim = build(0, world)
    out = Path(spec["out"])
    step = 0
    for save in spec["saves"]:
        train(model, optim, spec.get("train_steps", 2), step)
        step = save["step"]
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "extra": {"step": step}}
        writer = TieredWriter(**tiers(spec), step=step)
        mode = save["mode"]
        if mode == "sync":
            dcp.save(state, storage_writer=writer)
        else:
            kind = AsyncCheckpointerType.THREAD if mode == "thread" else AsyncCheckpointerType.PROCESS
            dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind).result()
        d = digest(model, optim)
        if dist.get_rank() == 0:
            (out / f"saved-{step}.json").write_text(json.dumps(d, sort_keys=True))
        dist.barrier()
    if spec.get("cold") and spec.get("drain"):
        statuses = wait_for_migrations(Store.of(**tiers(spec)), timeout=180)
        if dist.get_rank() == 0:
            summary = {s.name: {"state": s.state.value, "error": s.error} for s in statuses}
            (out / "migration.json").write_text(json.dumps(summary, sort_keys=True))
        dist.barrier()


def load(spec: dict[str, Any]) -> None:
    world = dist.get_world_size()
    out = Path(spec["out"])
    for entry in spec["loads"]:
        model, optim = build(12345, world)  # different init: the load must overwrite all
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "extra": {"step": -1}}
        reader = TieredReader(
            Store.of(**tiers(spec), node_local=spec.get("node_local", False)),
            step=entry.get("step"),
            name=entry.get("name"),
        )
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        d = digest(model, optim)
        (out / f"sources-{entry['tag']}-rank{dist.get_rank()}.json").write_text(json.dumps(reader.sources))
        if dist.get_rank() == 0:
            result = {"digest": d, "name": reader.manifest.name, "step": state["extra"]["step"]}
            (out / f"loaded-{entry['tag']}.json").write_text(json.dumps(result, sort_keys=True))
        dist.barrier()


def policy(text: str):  # "last:2|every:10" -> keep_last(2) | keep_every(10)
    from tierstore.lifecycle import retention

    parts = [
        getattr(retention, f"keep_{kind}")(int(arg)) for kind, arg in (p.split(":") for p in text.split("|"))
    ]
    result = parts[0]
    for part in parts[1:]:
        result = result | part
    return result


def manager(spec: dict[str, Any]) -> None:
    """Train ``steps`` steps under a CheckpointManager saving every ``save_every``."""
    from tierstore import CheckpointManager

    world = dist.get_world_size()
    model, optim = build(0, world)
    out = Path(spec["out"])
    mgr = CheckpointManager(
        **tiers(spec),
        save_every=spec["save_every"],
        retention=Retention(hot=policy(spec["hot_policy"]), cold=policy(spec["cold_policy"])),
    )
    msd, osd = get_state_dict(model, optim)
    assert mgr.load_latest({"model": msd, "optim": osd, "extra": {"step": -1}}) is None
    for step in range(1, spec["steps"] + 1):
        train(model, optim, 1, step)
        msd, osd = get_state_dict(model, optim)
        if mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}):
            d = digest(model, optim)
            if dist.get_rank() == 0:
                (out / f"saved-{step}.json").write_text(json.dumps(d, sort_keys=True))
    mgr.close()
    if dist.get_rank() == 0:
        (out / "stalls.json").write_text(json.dumps(mgr.stalls))


def manager_load(spec: dict[str, Any]) -> None:
    from tierstore import CheckpointManager

    model, optim = build(12345, dist.get_world_size())
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    with CheckpointManager(**tiers(spec)) as mgr:
        step = mgr.load_latest(state)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    d = digest(model, optim)
    if dist.get_rank() == 0:
        result = {"digest": d, "step": step, "extra_step": state["extra"]["step"]}
        (Path(spec["out"]) / "loaded-manager.json").write_text(json.dumps(result, sort_keys=True))


def manager_fallback(spec: dict[str, Any]) -> None:
    """Save steps 1 and 2 with a CheckpointManager, flip a byte inside rank 1's shard of
    step 2, then ``load_latest`` on every rank: all must fall back to step 1 together."""
    from tierstore import CheckpointManager, StagingOptions
    from tierstore.format import layout
    from tierstore.tiers.tier import Tier

    world, rank = dist.get_world_size(), dist.get_rank()
    model, optim = build(0, world)
    out = Path(spec["out"])
    with CheckpointManager(**tiers(spec), staging=StagingOptions(async_save=False)) as mgr:
        for step in (1, 2):
            train(model, optim, 1, step)
            msd, osd = get_state_dict(model, optim)
            mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}, force=True)
            if step == 1:
                first = digest(model, optim)
    if rank == 0:
        tier = Tier("hot", tiers(spec)["hot"])
        manifest = tier.find_manifest(layout.default_name(2))
        shard = Path(tier.url, tier.file_key(manifest.name, manifest.attempt, "__1_0.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    model, optim = build(12345, world)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    with CheckpointManager(**tiers(spec)) as mgr:
        step = mgr.load_latest(state)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result = {"step": step, "extra_step": state["extra"]["step"], "same": digest(model, optim) == first}
    (out / f"fallback-rank{rank}.json").write_text(json.dumps(result))


def manager_runs(spec: dict[str, Any]) -> None:
    """Run A (no run named) saves steps 1-3; then on every rank: run B's ``load_latest``
    finds nothing of its own, ``RunOptions("B", strict=True)`` raises on every rank (none left
    waiting in a collective), and a manager without a run name resumes A's step 3."""
    from tierstore import CheckpointManager, RunOptions, StagingOptions
    from tierstore.errors import ConfigError

    world, rank = dist.get_world_size(), dist.get_rank()
    model, optim = build(0, world)
    sync = StagingOptions(async_save=False)
    with CheckpointManager(**tiers(spec), staging=sync, retention=Retention(hot=policy("last:10"))) as a:
        for step in (1, 2, 3):
            train(model, optim, 1, step)
            msd, osd = get_state_dict(model, optim)
            a.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}, force=True)
    result: dict[str, Any] = {}
    model, optim = build(12345, world)
    msd, osd = get_state_dict(model, optim)
    with CheckpointManager(
        **tiers(spec), run="B", staging=sync, retention=Retention(hot=policy("last:10"))
    ) as b:
        result["named"] = b.load_latest({"model": msd, "optim": osd, "extra": {"step": -1}})
    try:
        CheckpointManager(**tiers(spec), run=RunOptions("B", strict=True))
        result["strict"] = None
    except ConfigError as err:
        result["strict"] = str(err)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    with CheckpointManager(**tiers(spec), retention=Retention(hot=policy("last:10"))) as unnamed:
        result["unnamed"] = unnamed.load_latest(state)
    result["extra_step"] = state["extra"]["step"]
    (Path(spec["out"]) / f"runs-rank{rank}.json").write_text(json.dumps(result))


def manager_cold_down(spec: dict[str, Any]) -> None:
    """Node-local hot tiers, the cold tier down (a closed port): ``load_latest`` must raise
    the same error on every rank, none left waiting; then ``close(timeout=T)`` after a save
    returns in about T, not once per wait inside it."""
    from tierstore import CheckpointManager
    from tierstore.migration.migrator import MigrationOptions
    from tierstore.retry import RetryPolicy

    rank, out = dist.get_rank(), Path(spec["out"])
    retry = RetryPolicy(attempts=2, deadline=2.0, initial=0.01, maximum=0.05)
    options = {
        "endpoint_url": spec["endpoint"],
        "key": "testing",
        "secret": "testing",
        "region": "us-west-2",
        "retry": retry,
    }
    mgr = CheckpointManager(
        Store(tiers(spec)["hot"], spec["cold"], cold_options=options, node_local=True),
        retention=Retention(hot_min_free=None),
        migration=MigrationOptions(retry=retry, commit_timeout=5),
    )
    model, optim = build(0, dist.get_world_size())
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        mgr.load_latest(state)
        result["load"] = "returned"
    except Exception as err:
        result["load"] = type(err).__name__
    result["load_seconds"] = time.monotonic() - started
    mgr.save(1, state, force=True)
    started = time.monotonic()
    try:
        mgr.close(timeout=spec["close_timeout"])
        result["close"] = "returned"
    except Exception as err:
        result["close"] = type(err).__name__
    result["close_seconds"] = time.monotonic() - started
    (out / f"cold-down-rank{rank}.json").write_text(json.dumps(result))


def manager_node_local_resume(spec: dict[str, Any]) -> None:
    """Node-local hot tiers: a run whose cold tier was unreachable leaves its saves pending;
    the next run's managers (every rank its own files, the coordinator the commits) finish
    them at start."""
    from tierstore import CheckpointManager, list_checkpoints
    from tierstore.errors import MigrationFailed
    from tierstore.migration.migrator import MigrationOptions
    from tierstore.retry import RetryPolicy

    rank, out = dist.get_rank(), Path(spec["out"])
    retry = RetryPolicy(attempts=2, deadline=2.0, initial=0.01, maximum=0.05)
    config = MigrationOptions(retry=retry, commit_timeout=20, poll_interval=0.05)
    model, optim = build(0, dist.get_world_size())
    blocked = Path(spec["blocker"])
    mgr = CheckpointManager(
        Store(tiers(spec)["hot"], str(blocked / "cold"), node_local=True),
        retention=Retention(hot_min_free=None),
        migration=config,
    )
    for step in (1, 2):
        msd, osd = get_state_dict(model, optim)
        mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}, force=True)
    try:
        mgr.close(timeout=10)
        first = "returned"
    except MigrationFailed:
        first = "MigrationFailed"
    dist.barrier()
    if rank == 0:
        blocked.unlink()  # the cold tier is reachable again
    dist.barrier()
    again = CheckpointManager(
        Store(tiers(spec)["hot"], str(blocked / "cold"), node_local=True),
        retention=Retention(hot_min_free=None),
        migration=config,
    )
    again.close(timeout=60)
    dist.barrier()  # the coordinator's close returns once it has committed: then look
    result = {
        "first": first,
        "cold": [c.step for c in list_checkpoints(Store(cold=str(blocked / "cold")))],
    }
    (out / f"node-local-resume-rank{rank}.json").write_text(json.dumps(result))


def manager_preempt(spec: dict[str, Any]) -> None:
    """Resume (if there is a checkpoint), then train one step at a time under a manager
    watching for a preemption notice, writing ``out/progress-rank<r>`` after each step, until
    a ``save()`` acts on the notice: write the digest saved there (``preempted.json``, rank 0)
    and each rank's report (``preempted-rank<r>.json``), close, and exit 0.

    ``reads_preempted: false``: the README's loop, which saves every step and never reads
    ``preempted`` (rank 0 writes each saved step's digest to ``saved.json``): the manager
    ends the process. ``fail_rank``/``fail_at``: that rank raises at that step, while the others spend
    ``busy_seconds`` in something of their own (a validation pass) before their next
    collective."""
    from tierstore import CheckpointManager, PreemptionOptions

    rank = dist.get_rank()
    model, optim = build(0, dist.get_world_size())
    out = Path(spec["out"])
    mgr = CheckpointManager(
        Store(**tiers(spec), cold_options=spec.get("cold_options"), node_local=spec.get("node_local", False)),
        save_every=spec["save_every"],
        retention=Retention(hot_min_free=None),
        preemption=PreemptionOptions(grace_seconds=spec["grace"]),
    )
    msd, osd = get_state_dict(model, optim)
    extra = {"step": 0}
    start = mgr.load_latest({"model": msd, "optim": osd, "extra": extra}) or 0
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    resumed = {"step": start, "extra": extra["step"], "digest": digest(model, optim) if start else None}
    (out / f"resumed-rank{rank}.json").write_text(json.dumps(resumed, sort_keys=True))
    reads = spec.get("reads_preempted", True)  # False: the README's loop, which never reads it
    for step in range(start + 1, start + 100_000):
        if step == spec.get("fail_at") and rank == spec.get("fail_rank"):
            raise RuntimeError(f"rank {rank} fails at step {step} (the test's doing)")
        if step == spec.get("fail_at") and rank != spec.get("fail_rank"):
            time.sleep(spec.get("busy_seconds", 0))  # a long validation pass, no collective in it
        train(model, optim, 1, step)
        (out / f"progress-rank{rank}").write_text(str(step))
        time.sleep(0.05)
        msd, osd = get_state_dict(model, optim)
        saved = mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}})
        if saved and not reads:  # the process may end at the next save()
            d = digest(model, optim)  # a collective: every rank
            if rank == 0:
                (out / "saved.json").write_text(json.dumps({"step": step, "digest": d}, sort_keys=True))
        if saved and reads and mgr.preempted:
            d = digest(model, optim)
            if rank == 0:
                (out / "preempted.json").write_text(json.dumps({"step": step, "digest": d}, sort_keys=True))
            report = mgr.preemption
            assert report is not None
            (out / f"preempted-rank{rank}.json").write_text(json.dumps(report.__dict__))
            break
    mgr.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ops = {
        "train_save": train_save,
        "load": load,
        "manager": manager,
        "manager_load": manager_load,
        "manager_fallback": manager_fallback,
        "manager_runs": manager_runs,
        "manager_cold_down": manager_cold_down,
        "manager_node_local_resume": manager_node_local_resume,
        "manager_preempt": manager_preempt,
    }
    ops[spec["op"]](spec)
    leave_cleanly()


if __name__ == "__main__":
    main()
