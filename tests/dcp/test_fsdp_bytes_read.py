"""Four real ranks (gloo, CPU) save an FSDP2 model and its AdamW state raw, then load it into
fresh ranks: each rank reads about what its own load plan needs, not the files that DCP's
dedup spread its replicated items over (before range reads: ~4x its share).

This file is also the job each rank runs (``python tests/dcp/test_fsdp_bytes_read.py SPEC``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

WORLD = 4


def test_each_rank_reads_what_its_plan_needs(tmp_path: Path) -> None:
    from launch import run_job

    out = tmp_path / "out"
    out.mkdir()
    job = run_job({"hot": str(tmp_path / "hot"), "out": str(out)}, WORLD, script=Path(__file__), timeout=120)
    assert job.ok, job.describe()
    for rank in range(WORLD):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["same"], (rank, result)
        read, needed = sum(result["bytes_read"].values()), result["needed"]
        assert needed > 0 and result["data_size"] > 3 * needed, (rank, result)  # not whole files
        assert needed <= read <= 1.1 * needed + result["metadata_size"], (rank, result)


def _job(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dist_job import Net, digest, train
    from helpers import shard_per_block
    from launch import leave_cleanly
    from test_range_reads import plan_bytes
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tierstore import ReaderOptions, TieredReader, TieredWriter

    class Recording(DefaultLoadPlanner):
        needed = 0

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            plan = super().finish_plan(central_plan)
            self.needed = plan_bytes(plan, self.metadata.storage_data)  # type: ignore[union-attr]
            return plan

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Net(vocab=256, dim=256)  # items of 64 KiB and up: alignment padding stays small
        shard_per_block(model, WORLD)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    rank = dist.get_rank()
    model, optim = build(0)
    train(model, optim, 1, 1)
    msd, osd = get_state_dict(model, optim)
    writer = TieredWriter(spec["hot"], step=1)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    saved = digest(model, optim)
    model, optim = build(7)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    reader, planner = TieredReader(spec["hot"], options=ReaderOptions(lease=False)), Recording()
    dcp.load(state, storage_reader=reader, planner=planner)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    manifest = reader.manifest
    assert manifest is not None
    meta = manifest.file(manifest.metadata_file)
    assert meta is not None
    result = {
        "same": digest(model, optim) == saved,
        "bytes_read": reader.bytes_read,
        "needed": planner.needed,
        "metadata_size": meta.size,
        "data_size": manifest.total_size - meta.size,
    }
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(result))
    leave_cleanly()


if __name__ == "__main__":
    import datetime
    import warnings

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: dist_job.py, helpers.py, launch.py
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    _job(json.loads(sys.argv[1]))
