"""One rank of a job with copies on other nodes (``ManagerOptions(redundancy=)``): FSDP2 +
AdamW on CPU over gloo, "nodes" of ``local_world`` ranks each with a hot directory of its own,
the cold tier an S3 URL on a closed port (or a directory), as ``spec`` says.

Run by ``tests/launch.py`` with a JSON spec as argv[1]. Operations:

* ``save``: train and save ``saves`` steps through a manager with ``redundancy``; write the
  digest of the state each step saved to ``out/saved.json`` (rank 0) and each rank's health to
  ``out/health-rank<r>.json``; then either close (``close``: the error's text in
  ``out/close-rank<r>.json``) or, with ``hang``, write ``out/ready-rank<r>`` and sleep until
  killed (the test SIGKILLs a node).
* ``preempt``: rank 1 is sent SIGTERM before step ``at``; the save on the notice, its copies
  and close() are reported in ``out/preempted-rank<r>.json``.
* ``resume``: a fresh model (another init), the same constructor arguments, ``load_latest``;
  write the loaded state's digest, the step, health (where every file came from, what the
  start restored) to ``out/resumed-rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_job import build, digest, train
from launch import leave_cleanly
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierstore import CheckpointManager, Parity, Replicas, Retention, Store
from tierstore.errors import TierstoreError
from tierstore.migration.migrator import MigrationOptions
from tierstore.options import ManagerOptions, PreemptionOptions
from tierstore.retry import RetryPolicy


def scheme(spec: dict[str, Any]) -> Replicas | Parity:
    kind, *args = spec["redundancy"]
    return Replicas(*args) if kind == "replicas" else Parity(*args)


def manager(spec: dict[str, Any]) -> CheckpointManager:
    rank = dist.get_rank()
    node = rank // spec["local_world"]
    hot = str(Path(spec["root"]) / f"node{node}")
    retry = RetryPolicy(attempts=2, deadline=2.0, initial=0.01, maximum=0.05)
    if spec["cold"].startswith("s3://"):
        options = {
            "endpoint_url": spec["endpoint"],
            "key": "testing",
            "secret": "testing",
            "region": "us-west-2",
            "retry": retry,
        }
        store = Store(hot, spec["cold"], cold_options=options, node_local=True)
    else:
        store = Store(hot, spec["cold"], node_local=True)
    grace = spec.get("grace")
    return CheckpointManager(
        store,
        retention=Retention(hot_min_free=None),
        migration=MigrationOptions(retry=retry, commit_timeout=5),
        options=ManagerOptions(close_timeout=spec.get("close_timeout", 8), redundancy=scheme(spec)),
        preemption=PreemptionOptions(grace_seconds=grace) if grace else True,
    )


def health(mgr: CheckpointManager) -> dict[str, Any]:
    h = mgr.health()
    return {"copies": h.copies, "load_sources": h.load_sources}


def save(spec: dict[str, Any]) -> None:
    rank, world, out = dist.get_rank(), dist.get_world_size(), Path(spec["out"])
    mgr = manager(spec)
    model, optim = build(0, world)
    saved = {}
    for step in spec["saves"]:
        train(model, optim, 2, step)
        saved[step] = digest(model, optim)  # a collective: every rank, before a test's kill can come
        if rank == 0:
            (out / "saved.json").write_text(json.dumps(saved))
        msd, osd = get_state_dict(model, optim)
        mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}, force=True)
    # The last save committed, its copies verified on the peers (and with "drain", in cold).
    mgr.wait(migrations=bool(spec.get("drain")))
    (out / f"health-rank{rank}.json").write_text(json.dumps(health(mgr)))
    if spec.get("hang"):
        (out / f"ready-rank{rank}").write_text("ready")
        while True:  # until the test SIGKILLs this node, then the others
            time.sleep(1)
    started, result = time.monotonic(), "returned"
    try:
        mgr.close()
    except TierstoreError as err:
        result = f"{type(err).__name__}: {err}"
    (out / f"close-rank{rank}.json").write_text(
        json.dumps({"close": result, "seconds": time.monotonic() - started})
    )


def preempt(spec: dict[str, Any]) -> None:
    """Save every step; rank 1 gets SIGTERM before step ``at``: the next save() saves on
    every rank at once and pushes it to the peers (and tries the cold tier) within the grace
    period. The notice's report, each rank's copies and close()'s error go to
    ``out/preempted-rank<r>.json``; the state saved last to ``out/saved.json``."""
    rank, world, out = dist.get_rank(), dist.get_world_size(), Path(spec["out"])
    mgr = manager(spec)
    model, optim = build(0, world)
    saved: dict[int, Any] = {}
    signalled = 0.0
    for step in range(1, spec["at"] + 3):
        train(model, optim, 1, step)
        saved[step] = digest(model, optim)
        if rank == 0:
            (out / "saved.json").write_text(json.dumps(saved))
        if step == spec["at"] and rank == 1:
            signalled = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, on one rank
        msd, osd = get_state_dict(model, optim)
        mgr.save(step, {"model": msd, "optim": osd, "extra": {"step": step}}, force=step % 2 == 0)
        if mgr.preempted:
            break
    report = mgr.preemption
    result: dict[str, Any] = {
        "step": report.step if report else None,
        "report": report.summary() if report else None,
        **health(mgr),
    }
    try:
        mgr.close()
        result["close"] = "returned"
    except TierstoreError as err:
        result["close"] = f"{type(err).__name__}: {err}"
    result["seconds_since_signal"] = time.monotonic() - signalled if signalled else None
    (out / f"preempted-rank{rank}.json").write_text(json.dumps(result))


def resume(spec: dict[str, Any]) -> None:
    rank, world, out = dist.get_rank(), dist.get_world_size(), Path(spec["out"])
    started = time.monotonic()
    mgr = manager(spec)
    model, optim = build(12345, world)  # another init: the load must overwrite all of it
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "extra": {"step": -1}}
    step = mgr.load_latest(state)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    seconds = time.monotonic() - started
    result = {
        "step": step,
        "extra": state["extra"]["step"],
        "digest": digest(model, optim),
        "seconds": seconds,
        **health(mgr),
    }
    (out / f"resumed-rank{rank}.json").write_text(json.dumps(result))
    if spec.get("save_after"):
        train(model, optim, 1, spec["save_after"])
        msd, osd = get_state_dict(model, optim)
        mgr.save(
            spec["save_after"],
            {"model": msd, "optim": osd, "extra": {"step": spec["save_after"]}},
            force=True,
        )
        mgr.wait(migrations=False)
        (out / f"after-rank{rank}.json").write_text(json.dumps(health(mgr)))
    try:
        mgr.close()
    except TierstoreError:
        pass  # the cold tier is down: the checkpoints stay pending (and protected)


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["LOCAL_WORLD_SIZE"] = str(spec["local_world"])  # torchrun's, for "nodes" on one host
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    {"save": save, "resume": resume, "preempt": preempt}[spec["op"]](spec)
    leave_cleanly()


if __name__ == "__main__":
    main()
