"""Can s3torchconnector's DCP writer reach the local S3 server? ``python -m
benchmarks.jobs.probe_s3torch ENDPOINT BUCKET`` prints ``{"available": ..., "reason": ...}``."""

from __future__ import annotations

import json
import sys
import warnings
from importlib import metadata

warnings.filterwarnings("ignore")


def probe(endpoint: str, bucket: str) -> dict[str, object]:
    try:
        version = metadata.version("s3torchconnector")
    except metadata.PackageNotFoundError:
        return {
            "available": False,
            "reason": "s3torchconnector is not installed (pip install "
            "s3torchconnector failed or was skipped)",
        }
    try:
        import torch
        import torch.distributed.checkpoint as dcp

        from benchmarks.infra.servers import S3Target
        from benchmarks.jobs.writers import s3torch_reader, s3torch_writer

        target = S3Target(endpoint, bucket)
        state = {"w": torch.arange(1024.0)}
        dcp.save(state, storage_writer=s3torch_writer(target.url("probe"), target), no_dist=True)
        loaded = {"w": torch.zeros(1024)}
        dcp.load(loaded, storage_reader=s3torch_reader(target.url("probe"), target), no_dist=True)
        if not torch.equal(state["w"], loaded["w"]):
            return {"available": False, "version": version, "reason": "round trip differs"}
    except BaseException as err:  # CheckpointException is a BaseException
        return {
            "available": False,
            "version": version,
            "reason": f"cannot save/load through the local server: {type(err).__name__}: {err}"[:500],
        }
    return {
        "available": True,
        "version": version,
        "reason": "endpoint set through its S3Client(endpoint=...), path-style addressing",
    }


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], sys.argv[2])))
