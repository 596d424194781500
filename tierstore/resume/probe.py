"""The torch side of :mod:`tierstore.resume.check`: state digests, the probe loss, the fresh process.

``python -m tierstore.resume.probe SPEC.json`` is one rank of the fresh job: it joins the job's own
process group (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), builds the probe's
objects, loads the checkpoint through ``TieredReader`` with every key optional (so a key the
checkpoint lacks is reported, not fatal), and writes the missing keys, the digest of every key
and the loss to the spec's ``out`` file.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierstore._dist import rank_world
from tierstore.resume.probes import Probe, load_probe
from tierstore.resume.state import ResumePlanner, capture_rng, restore_rng
from tierstore.tiers.tier import Store

__all__ = ["capture", "digest_state", "probe_loss", "rank_world", "main"]

log = logging.getLogger(__name__)


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def digest_state(state: dict[str, Any]) -> dict[str, str]:
    """A digest of every key, flattened as DCP names them; tensors by this rank's own bytes."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(_plain(state))
    return {key: _digest(value) for key, value in flat.items()}


def _digest(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"dtensor{tuple(value.shape)}{value.placements}:" + _digest(value.to_local())
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1).contiguous().cpu()
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return f"{flat.dtype}{tuple(value.shape)}:{hashlib.sha256(data).hexdigest()[:32]}"
    text = repr(value)
    return text if len(text) <= 80 else "repr:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def probe_loss(probe: Probe, state: dict[str, Any]) -> float:
    """The probe's loss, with no gradients, leaving this process's RNG as it found it."""
    saved = capture_rng()
    try:
        with torch.no_grad():
            loss = probe.loss(state)
        return float(loss.item() if isinstance(loss, torch.Tensor) else loss)
    finally:
        restore_rng(saved)


def capture(probe: Probe, state: dict[str, Any]) -> dict[str, Any]:
    """The live side's record: this rank's digests first (the loss must not move them), then the loss."""
    rank, _ = rank_world()
    digests = digest_state(state)
    return {"rank": rank, "digests": digests, "loss": probe_loss(probe, state)}


# -- the fresh process ------------------------------------------------------------------------


def _fresh(spec: dict[str, Any]) -> dict[str, Any]:
    from tierstore.dcp.reader import TieredReader

    probe = load_probe(spec["probe"])()
    state = probe.build()
    planner = ResumePlanner(optional=lambda key: True)  # report what is missing, load the rest
    store = Store.of(
        spec["hot"],
        spec["cold"],
        hot_options=spec["hot_options"],
        cold_options=spec["cold_options"],
        node_local=spec["node_local"],
    )
    reader = TieredReader(store, name=spec["name"])
    dcp_load(state, storage_reader=reader, planner=planner)
    digests = digest_state(state)
    return {
        "missing": planner.missing,
        "digests": digests,
        "loss": probe_loss(probe, state),
        "step": reader.manifest.step if reader.manifest else None,
    }


def _leave_together(ok: bool) -> None:
    # Tearing gloo down while a peer still talks to it can abort the process ("terminate
    # called without an active exception"); a failed peer is gone already, so do not wait then.
    if ok:
        try:
            dist.barrier()
        except Exception as err:
            log.warning("barrier before exit failed: %s", err)


def main(argv: list[str] | None = None) -> int:
    spec_path = (argv or sys.argv[1:])[0]
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"error": None}
    timeout = datetime.timedelta(seconds=float(spec.get("timeout", 600)))
    try:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        result.update(_fresh(spec))
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        result["rank"] = rank_world()[0]
        Path(spec["out"]).write_text(json.dumps(result))
        if dist.is_initialized():
            _leave_together(result["error"] is None)
            gc.collect()  # FSDP2 modules sit in reference cycles that would hold the group into exit
            dist.destroy_process_group()
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
