"""Verify a resume: load a checkpoint in fresh processes and compare it with the run that saved it.

A resume that runs but diverges almost always means missing RNG or optimizer state, so a
resume is proven, not assumed: right after a save, every rank computes the loss on one fixed
batch and a digest of every key of its live state; fresh processes (one per rank, same world
size) build the model and optimizer from scratch, load the checkpoint, and do the same. The
report names each key that is missing from the checkpoint or differs, by part (model,
optimizer, scheduler, rng, step, data), and the two losses. CPU runs are bit-exact, so the
default tolerance is zero; pass ``rtol``/``atol`` for GPU kernels that are not deterministic.

The user's code says how to build things through a *probe*: a function, importable in a fresh
process as ``"package.module:function"`` or ``"path/to/script.py:function"``, that returns a
:class:`Probe`. It must be cheap to call; only ``build`` creates the model::

    def probe() -> Probe:
        batch = fixed_batch()                      # the same batch every time
        def build():                               # in the fresh process, process group ready
            model, optim, sched = make_model_and_optimizer()
            return {"train": TrainingState(model, optim, sched, sampler=make_sampler())}
        def loss(state):                           # the same keys as saved
            return loss_fn(state["train"].model, batch)
        return Probe(build=build, loss=loss)

    manager.save(step, {"train": train}, force=True)
    report = manager.verify_resume(probe, {"train": train})   # right after the save
    assert report.ok, report.summary()

The loss runs under ``torch.no_grad()`` and the live process's RNG is put back afterwards, so
verifying never changes the training run. Call it before the next training step: the live
state is compared as it is at that moment. This module imports torch only when it runs
something, so the ``tierstore verify-resume`` command starts without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierstore import _dist
from tierstore.errors import ConfigError, TierstoreError
from tierstore.resume.probes import Probe, ProbeFactory, load_probe, probe_spec
from tierstore.resume.report import Mismatch, ResumeReport, assemble, compare, rank_outcome
from tierstore.tiers.catalog import resolve
from tierstore.tiers.tier import Store, TierURL

__all__ = [
    "Probe",
    "ResumeReport",
    "Mismatch",
    "verify_resume",
    "verify_checkpoint",
    "load_probe",
    "probe_spec",
    "compare",
]

log = logging.getLogger(__name__)

# -- fresh processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _child_env(rank: int, world: int, addr: str, port: int, local_rank: int) -> dict[str, str]:
    # torchrun's variables would send the fresh processes to the live job's rendezvous store.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    # The probe must import in the fresh process as it does here.
    paths = [*(p for p in sys.path if p), os.getcwd(), env.get("PYTHONPATH", "")]
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(paths).rstrip(os.pathsep),
    )
    return env


def spawn_fresh(
    spec: Mapping[str, Any],
    workdir: Path,
    rank: int,
    world: int,
    addr: str,
    port: int,
    local_rank: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start the fresh process of ``rank``; it writes ``workdir/result-<rank>.json``."""
    spec_path = workdir / f"spec-{rank}.json"
    spec_path.write_text(json.dumps({**spec, "out": str(workdir / f"result-{rank}.json")}))
    env = _child_env(rank, world, addr, port, rank if local_rank is None else local_rank)
    with open(workdir / f"log-{rank}.txt", "wb") as log_file:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, "-m", "tierstore.resume.probe", str(spec_path)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def collect_fresh(proc: subprocess.Popen[bytes], workdir: Path, rank: int, timeout: float) -> dict[str, Any]:
    """Wait for a fresh process and read its result; a crash or timeout becomes an error entry."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
        return {"error": f"timed out after {timeout:.0f} s{_log_tail(workdir, rank)}"}
    result = workdir / f"result-{rank}.json"
    if not result.exists():
        return {"error": f"exited with {proc.returncode} before reporting{_log_tail(workdir, rank)}"}
    body: dict[str, Any] = json.loads(result.read_text())
    return body


def _log_tail(workdir: Path, rank: int, lines: int = 6) -> str:
    path = workdir / f"log-{rank}.txt"
    text = path.read_text(errors="replace").strip().splitlines()[-lines:] if path.exists() else []
    return (": " + " | ".join(text)) if text else ""


def _fresh_spec(probe: str, name: str, store: Store, node_local: bool, timeout: float) -> dict[str, Any]:
    hot, cold = store.hot, store.cold
    return {
        "probe": probe,
        "name": name,
        "hot": None if hot is None else hot.url,
        "cold": None if cold is None else cold.url,
        "hot_options": {} if hot is None else hot.options,
        "cold_options": {} if cold is None else cold.options,
        "node_local": node_local,
        "timeout": timeout,
    }


# -- from the command line: a checkpoint, no live process ------------------------------------


def verify_checkpoint(
    probe: str,
    store: Store | TierURL,
    *,
    name: str | None = None,
    step: int | None = None,
    nproc: int | None = None,
    record: str | os.PathLike[str] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    timeout: float = 600.0,
) -> ResumeReport:
    """Load a checkpoint into ``nproc`` fresh local processes and check it against ``record``.

    ``record`` is a directory a live run wrote with ``verify_resume(..., record_dir=...)``;
    it names the checkpoint (unless ``name``/``step`` do) and holds each rank's loss and state
    digests. Without it, the check is that the checkpoint loads completely into what the probe
    builds, and the loss after loading is reported.
    """
    live: list[dict[str, Any] | None]
    if record is not None:
        live = _read_record(Path(record))
        name = name or (live[0] or {}).get("checkpoint")
        nproc = nproc or len(live)
    store = Store.of(store)
    manifest, _ = resolve(store.tiers, step=step, name=name)
    nproc = nproc or manifest.world_size
    if record is None:
        live = [None] * nproc
    elif len(live) != nproc:
        raise ConfigError(f"the record holds {len(live)} ranks; verify with --nproc {len(live)}")
    spec = _fresh_spec(probe, manifest.name, store, False, timeout)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierstore-verify-") as tmp:
        workdir, port = Path(tmp), free_port()
        procs = [spawn_fresh(spec, workdir, r, nproc, "127.0.0.1", port) for r in range(nproc)]
        fresh = [collect_fresh(p, workdir, r, timeout) for r, p in enumerate(procs)]
    return compare(manifest.name, live, fresh, rtol=rtol, atol=atol, seconds=time.monotonic() - start)


def _read_record(directory: Path) -> list[dict[str, Any] | None]:
    files = sorted(directory.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise ConfigError(f"no live record (rank-<r>.json) in {directory}")
    return [json.loads(p.read_text()) for p in files]


# -- from the training run: every rank, right after a save -----------------------------------


def verify_resume(
    probe: str | ProbeFactory,
    state: dict[str, Any],
    *,
    store: Store | TierURL,
    name: str | None = None,
    step: int | None = None,
    group: Any = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    timeout: float = 600.0,
    record_dir: str | os.PathLike[str] | None = None,
) -> ResumeReport:
    """Check that a committed checkpoint restores ``state``: call on every rank, right after the save.

    ``name``/``step`` pick the checkpoint (default the newest). Every rank starts one fresh
    process; together they form a job of the same world size. Collective over ``group``
    (default the world), which must be idle: wait for pending saves first
    (``CheckpointManager.verify_resume`` does). Returns the same report on every rank.
    """
    from tierstore.resume import probe as _probe

    store = Store.of(store)
    spec_name = probe_spec(probe)
    factory = probe if callable(probe) else load_probe(probe)
    start = time.monotonic()
    rank, world = _dist.rank_world()
    picked: tuple[str, int] | TierstoreError | None = None
    if rank == 0:
        try:
            picked = resolve(store.committed_tiers, step=step, name=name)[0].name, free_port()
        except TierstoreError as err:  # every rank raises it, none waits for a partner
            picked = err
    picked = _dist.broadcast(picked, group)
    if isinstance(picked, TierstoreError):
        raise picked
    assert picked is not None
    chosen, port = picked
    live = _probe.capture(factory(), state)
    live["checkpoint"] = chosen
    if record_dir is not None:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        Path(record_dir, f"rank-{rank}.json").write_text(json.dumps(live))
    spec = _fresh_spec(spec_name, chosen, store, store.node_local, timeout)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tierstore-verify-") as tmp:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))  # the same device as this rank
        proc = spawn_fresh(spec, Path(tmp), rank, world, addr, port, local_rank)
        fresh = collect_fresh(proc, Path(tmp), rank, timeout)
    outcomes = _dist.all_gather(rank_outcome(live, fresh), group)  # problems only, not digests
    report = assemble(chosen, outcomes, rtol=rtol, atol=atol, seconds=time.monotonic() - start)
    (log.info if report.ok else log.error)("%s", report.summary())
    return report
