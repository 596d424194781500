"""GPU staging: ``python -m benchmarks.jobs.gpu SPEC.json OUT.json``.

Where CUDA is present: the stall of ``dcp.async_save`` (TieredWriter, hot tier) with DCP's
default stager for async_save (a blocking copy into pageable memory) against pinned-memory
staging (blocking, and asynchronous on a side stream), the state on the GPU. Elsewhere it
writes ``{"skipped": true, "reason": ...}`` and measures nothing.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import MiB, Record, await_async_save, now

warnings.filterwarnings("ignore")

# name -> StagingOptions(pinned, shared, async staging, non-blocking copy); None: DCP default
STAGERS: dict[str, tuple[bool, bool, bool, bool] | None] = {
    "dcp_default": None,
    "pinned_blocking": (True, False, False, False),
    "pinned_async": (True, False, True, True),
}


def skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        build = "CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return f"no CUDA device (torch {torch.__version__}, {build})"
    return None


def make_stager(options: tuple[bool, bool, bool, bool] | None) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return None if options is None else DefaultStager(StagingOptions(*options))


def save_once(state: dict[str, Any], hot: str, stager: Any) -> Record:
    import torch.distributed.checkpoint as dcp

    from tierstore import TieredWriter

    start = now()
    answer = dcp.async_save(state, storage_writer=TieredWriter(hot, name="ckpt"), async_stager=stager)
    stall, staged, commit = await_async_save(answer, start)
    return {"stall": stall, "staged": staged, "commit": commit}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    reason = skip_reason()
    if reason is not None:
        return {"skipped": True, "reason": reason}
    import torch

    count = max(1, spec["bytes"] // (64 * MiB))
    state = {f"w{i}": torch.rand(spec["bytes"] // count // 4, device="cuda") for i in range(count)}
    root = Path(tempfile.mkdtemp(dir=spec["scratch"]))
    records = []
    try:
        for name, options in STAGERS.items():
            stager = make_stager(options)
            for rep in range(-1, spec["reps"]):  # rep -1 warms up (pinned buffers, CUDA)
                hot = root / f"{name}-{rep}"
                record = {"variant": name, "rep": rep, **save_once(state, str(hot), stager)}
                shutil.rmtree(hot, ignore_errors=True)
                if rep >= 0:
                    records.append(record)
                    print(
                        f"    rep {rep + 1} {name:<16} stall {record['stall']:6.3f}s  "
                        f"staged {record['staged']:6.3f}s  commit {record['commit']:6.2f}s",
                        flush=True,
                    )
            if stager is not None:
                stager.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "skipped": False,
        "device": torch.cuda.get_device_name(),
        "bytes": spec["bytes"],
        "records": records,
    }


if __name__ == "__main__":
    module_main(run)
