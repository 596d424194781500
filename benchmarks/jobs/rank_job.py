"""One rank of a benchmark job: ``python -m benchmarks.jobs.rank_job SPEC.json`` (see launch.py).

Operations (``spec["op"]``):

* ``save``: for each rep, every case in turn (order rotated per rep): barrier, then time
  how long the training thread is blocked (``stall``), until the checkpoint is committed
  (``commit``) and, for tierstore with a cold tier, until the cold commit (``cold``); with
  the peak RSS growth of each. Checkpoint collectives run on their own gloo group, never
  on the training group (``async_save`` runs them on a background thread).
* ``load``: write one checkpoint per writer, then time ``dcp.load`` per reader.
* ``prepare``: write hot-only tierstore checkpoints of several sizes (for migration).

Each rank writes its records to ``out/rank<r>.json``; the caller merges them.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.infra.measure import Record
from benchmarks.infra.servers import S3Target
from benchmarks.jobs.loads import run_loads
from benchmarks.jobs.rank_context import Context
from benchmarks.jobs.saves import run_prepare, run_saves

warnings.filterwarnings("ignore")


OPS: dict[str, Callable[[Context], list[Record]]] = {
    "save": run_saves,
    "load": run_loads,
    "prepare": run_prepare,
}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = Context(
        spec=spec,
        rank=rank,
        world=world,
        group=dist.new_group(backend="gloo"),
        mesh=init_device_mesh("cpu", (world,)),
        scratch=Path(spec["scratch"]),
        targets={k: S3Target(**v) for k, v in spec.get("s3", {}).items()},
    )
    started = time.time()
    records = OPS[spec["op"]](ctx)
    for record in records:
        record.setdefault("rank", rank)
    out = Path(spec["out"])
    (out / f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    ctx.say(f"    ({spec['op']} job: {time.time() - started:.0f}s on {world} ranks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
