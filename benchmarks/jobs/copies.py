"""Copies on other nodes (``ManagerOptions(redundancy=Replicas(2))``): one rank of the job,
``python -m benchmarks.jobs.copies SPEC.json``, and :func:`launch`, which starts the job.

4 gloo processes as 2 "nodes" of 2 ranks (``LOCAL_WORLD_SIZE=2``, the manager's node of a rank
is ``rank // 2``), each node with a hot directory of its own (``node<N>``), the cold tier a
local directory (``MigrationOptions`` default): the cold tier is not what is measured.
Phases (``spec["phases"]``):

* ``stall``: a training-shaped loop (square ``Linear`` layers under FSDP2 over the 4 ranks,
  AdamW, a step of compute padded to ``step_seconds`` as an accelerator's step leaves the
  host idle, a save every ``every`` steps through a ``CheckpointManager``), with and without
  ``ManagerOptions(redundancy=Replicas(2))``, in an order rotated by rep. Per save: ``manager.stalls`` and
  the CPU time of the training thread inside ``save()``; per loop: its wall time, the
  compute part of its steps, the process's CPU time (every thread: replication included)
  until the last save's copies are verified, and each background round's transfer time
  and bytes (``Protection``, from the manager's copies part).
* ``copies``: once on the scratch disk and once on tmpfs (``/dev/shm``), a state of
  ``bytes`` (float32 DTensors sharded over the 4 ranks) saved through a manager with
  ``Replicas(2)``; then, in an order rotated by rep,

  - ``protect``: one more replication round of that checkpoint (``Peers.protect``, what the
    manager's background thread runs after each commit), timed from a barrier on every
    rank: the whole round and its transfers (``Protection.seconds``);
  - ``raw_plan``: the same byte count over plain gloo ``dist.send``/``dist.recv`` between
    the same pairs (rank r and rank (r + 2) % 4), chunks of ``wire.CHUNK``, in the round's
    order (ranks 0 and 1 send, then receive);
  - ``raw_duplex``: the same, both directions of a pair at once (``isend`` beside ``recv``);
  - ``raw_disk``: ``raw_duplex`` with every received chunk written to a file in the node's hot
    directory, fsynced at the end: the least any copy that must survive a crash of its holder pays;

  then the restore of a lost node: node 1's directory deleted and, in an order rotated by
  rep,

  - ``peers``: a manager started again with the same arguments on every rank (its
    constructor rebuilds node 1 from node 0's copies); right after it, ``start``: the same
    start with nothing lost (what a start costs anyway);
  - ``cold``: the same bytes node 1 lost (its ranks' own files into its hot tier, the files
    it kept for node 0 into its replica namespace, the ``.metadata``) copied from the cold
    tier by node 1's ranks, each file verified and durable (``copy_file``, what
    ``tierstore.restore`` copies a file with).

Every measurement starts at a barrier; each rank records its wall and CPU time
(``getrusage``: every thread), the driver merges ranks (times: the slowest; bytes and CPU
seconds: summed). Files just written are read back from the page cache on both sides of each
comparison (no cache is dropped: the other engineers' processes share the machine).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from benchmarks.infra.launch import ROOT, JobFailed, rank_env
from benchmarks.infra.measure import MiB, Record, cpu_seconds, now
from tests.launch import free_port, kill_group, start_rank, wait_ranks

warnings.filterwarnings("ignore")

WORLD = 4
LOCAL = 2  # ranks per node: 2 nodes
VARIANTS = ("plain", "replicas")  # the stall loop: without and with Replicas(2)
TRANSFERS = ("protect", "raw_plan", "raw_duplex", "raw_disk")
RESTORES = ("peers", "cold")
MEDIA = ("disk", "tmpfs")
TMPFS = Path("/dev/shm")
TENSOR_BYTES = 16 * MiB  # per tensor and rank in the copies phase's state
BATCH = 16
NAME = "step-0000000001"  # the checkpoint of the copies phase (layout.default_name(1))


def node_of(rank: int) -> int:
    return rank // LOCAL


def partner(rank: int) -> int:
    """The rank of the same local index on the other node: where Replicas(2) sends its files."""
    return (rank + LOCAL) % WORLD


def rotated(names: tuple[str, ...], rep: int) -> tuple[str, ...]:
    shift = rep % len(names)
    return names[shift:] + names[:shift]


# -- the driver's side ---------------------------------------------------------------------


def launch(spec: dict[str, Any], work: Path, *, timeout: float = 3600, grace: float = 10.0) -> list[Record]:
    """Run the job on 4 ranks as 2 nodes; every rank's records, merged (:func:`merge`).

    ``benchmarks/infra/launch.py``'s ``run_ranks`` with one change: ``LOCAL_WORLD_SIZE`` is
    the node's 2 ranks (it sets the world size, as torchrun does on one host)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(work)}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    logs: list[IO[bytes]] = []
    procs = []
    for rank in range(WORLD):
        log: IO[bytes] | None = None
        if rank:
            log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115
            logs.append(log)
        env = {**rank_env(rank, WORLD, port), "LOCAL_WORLD_SIZE": str(LOCAL), "LOCAL_RANK": str(rank % LOCAL)}
        command = [sys.executable, "-m", "benchmarks.jobs.copies", str(spec_file)]
        procs.append(start_rank(command, env, cwd=ROOT, output=log))
    try:
        wait_ranks(procs, timeout, grace)
    finally:
        for proc in procs:
            kill_group(proc)
        for stream in logs:
            stream.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "".join(_tail(work / f"rank{r}.log") for r in failed if r)
        raise JobFailed(
            f"copies ranks {failed} failed (exit codes {[procs[r].returncode for r in failed]}){tails}"
        )
    return merge([json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)])


def _tail(path: Path) -> str:
    try:
        return f"\n--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


SLOWEST = ("seconds", "transfer", "loop", "settled", "compute")
SUMMED = ("cpu", "bytes", "received")


def merge(per_rank: list[list[Record]]) -> list[Record]:
    """One record per measurement (phase, medium, variant, rep): times of the slowest rank (a
    step waits for it), bytes and CPU seconds summed over ranks. A stall loop's saves are
    merged save by save (the slowest rank's stall), then summarized over its steady saves
    (the first save of a manager allocates its staging buffers: left out)."""
    merged: dict[tuple[Any, ...], Record] = {}
    for records in per_rank:
        for record in records:
            key = (record["phase"], record.get("medium"), record["variant"], record["rep"])
            into = merged.setdefault(key, {k: record.get(k) for k in ("phase", "medium", "variant", "rep")})
            for name in (*SLOWEST, *SUMMED):
                value = record.get(name)
                if value is None:
                    continue
                previous = into.get(name)
                into[name] = (
                    value
                    if previous is None
                    else (previous + value if name in SUMMED else max(previous, value))
                )
            if record.get("copies") is not None:  # verified copies: the least protected rank's
                into["copies"] = min(into.get("copies", record["copies"]), record["copies"])
            for name in ("stalls", "save_cpu", "busy"):
                if name in record:
                    into.setdefault(f"_{name}", []).append(record[name])
            if "rounds" in record:
                into.setdefault("_rounds", []).append(record["rounds"])
            if record.get("error"):
                into["error"] = record["error"]
    out = []
    for record in merged.values():
        stalls = record.pop("_stalls", None)
        if stalls:
            per_save = [max(values) for values in zip(*stalls, strict=True)]  # the slowest rank's
            record["first_stall"], steady = per_save[0], per_save[1:] or per_save
            record["stall"] = statistics.median(steady)
            record["stall_max"] = max(steady)
            record["saves"] = len(per_save)
        save_cpu = record.pop("_save_cpu", None)
        if save_cpu:
            per_save = [sum(values) for values in zip(*save_cpu, strict=True)]  # every rank's
            record["save_cpu"] = statistics.median(per_save[1:] or per_save)
        busy = record.pop("_busy", None)
        if busy:  # saves that began while a rank still ran the previous save's round
            record["overlapped"] = sum(any(values) for values in zip(*busy, strict=True))
        rounds = record.pop("_rounds", None)
        if rounds:  # per round: the slowest rank's transfers, every rank's bytes
            by_round = list(zip(*rounds, strict=True))
            record["rounds"] = [[max(r[0] for r in one), sum(r[1] for r in one)] for one in by_round]
        out.append(record)
    return out


# -- one rank ------------------------------------------------------------------------------


def width(size: int, layers: int) -> int:
    """The side of ``layers`` square layers whose weights and AdamW's two moments are
    ``size`` bytes of float32 (``benchmarks/jobs/preemption_loops.py``'s model)."""
    return max(8, int((size / (3 * 4 * layers)) ** 0.5))


def dirs(root: Path, rank: int) -> tuple[str, str]:
    return str(root / f"node{node_of(rank)}"), str(root / "cold")


def manager(root: Path, rank: int, redundancy: Any) -> Any:
    from tierstore import CheckpointManager, Retention, Store
    from tierstore.options import ManagerOptions

    hot, cold = dirs(root, rank)
    return CheckpointManager(
        Store(hot, cold, node_local=True),
        retention=Retention(hot_min_free=None),  # the scratch disk is shared: no free-space rule
        options=ManagerOptions(close_timeout=600, redundancy=redundancy),
    )


def barrier() -> None:
    dist.barrier()


def clear(root: Path) -> None:
    barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    barrier()


def timed(run: Callable[[], Record | None]) -> Record:
    """``run`` from a barrier: this rank's wall and CPU seconds, with what it returned."""
    barrier()
    cpu, start = cpu_seconds(), now()
    extra = run() or {}
    return {"seconds": now() - start, "cpu": cpu_seconds() - cpu, **extra}


# stall: the training-shaped loop


class Trainer:
    """Square ``Linear`` layers under FSDP2 over every rank, AdamW; a step is its compute,
    then a sleep to ``step_seconds`` (an accelerator's step, during which the host is idle)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.side = width(spec["bytes"], spec["layers"])
        self.model = nn.Sequential(*(nn.Linear(self.side, self.side) for _ in range(spec["layers"])))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step_seconds = float(spec["step_seconds"])

    def step(self, step: int) -> float:
        """One step; the seconds of its compute (the rest of ``step_seconds`` is slept)."""
        started = now()
        x = torch.randn(BATCH, self.side, generator=torch.Generator().manual_seed(step))
        self.model(x).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad()
        compute = now() - started
        time.sleep(max(0.0, self.step_seconds - compute))
        return compute

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}


def loop(spec: dict[str, Any], trainer: Trainer, root: Path, variant: str, rep: int, saves: int) -> Record:
    """``saves`` saves, one every ``every`` steps, through a manager with or without
    ``Replicas(2)``; timed until the last save's copies are verified."""
    from tierstore import Replicas

    rank, every = dist.get_rank(), int(spec["every"])
    mgr = manager(root, rank, Replicas(2) if variant == "replicas" else None)
    stalls, save_cpu, computes, busy = [], [], [], []
    barrier()
    cpu, start = cpu_seconds(), now()
    for step in range(1, every * saves + 1):
        computes.append(trainer.step(step))
        if step % every == 0:
            state = trainer.state()
            busy.append(bool(mgr.health().copies.get("busy")))  # the previous save's round still running
            thread = time.thread_time()
            mgr.save(step, state, force=True)
            save_cpu.append(time.thread_time() - thread)
            stalls.append(mgr.stalls[step])
    looped = now() - start
    mgr.wait(migrations=False)  # the last save committed, and its copies verified on the peers
    settled, spent = now() - start, cpu_seconds() - cpu
    done = mgr.health().copies.get("rounds", {})
    rounds = [[done[name]["seconds"], done[name]["bytes"]] for name in sorted(done)]
    mgr.close()  # untimed: the cold tier's copies
    clear(root)
    return {
        "phase": "stall",
        "variant": variant,
        "rep": rep,
        "stalls": stalls,
        "save_cpu": save_cpu,
        "busy": busy,
        "compute": statistics.median(computes),
        "loop": looped,
        "settled": settled,
        "cpu": spent,
        "rounds": rounds,
        "bytes": local_bytes(trainer.state()),
    }


def local_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if hasattr(state, "to_local"):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def run_stall(spec: dict[str, Any]) -> list[Record]:
    trainer = Trainer(spec)
    root = Path(spec["scratch"]) / "stall"
    records = []
    for variant in VARIANTS:  # warm-up (imports, groups, the first FSDP steps): not reported
        loop(spec, trainer, root / f"warm-{variant}", variant, -1, 1)
    for rep in range(int(spec["reps"])):
        for variant in rotated(VARIANTS, rep):
            record = loop(spec, trainer, root / f"{variant}-{rep}", variant, rep, int(spec["saves"]))
            records.append(record)
            if dist.get_rank() == 0:
                steady = record["stalls"][1:] or record["stalls"]
                print(
                    f"    stall rep {rep + 1}/{spec['reps']} {variant:<8} stall (rank 0, median) "
                    f"{statistics.median(steady):.3f}s  loop {record['loop']:.2f}s  "
                    f"to copies verified {record['settled']:.2f}s  cpu {record['cpu']:.2f}s",
                    flush=True,
                )
    return records


# copies: replication throughput, then the restore of a lost node


def make_state(total: int, mesh: Any) -> dict[str, Any]:
    """``total`` bytes of float32 DTensors sharded over the ranks (each rank its own values)."""
    from torch.distributed.tensor import DTensor, Shard

    per_rank = total // WORLD
    count = max(1, per_rank // TENSOR_BYTES)
    numel = per_rank // count // 4
    gen = torch.Generator().manual_seed(dist.get_rank())
    return {
        f"layers.{i:03d}.weight": DTensor.from_local(
            torch.rand(numel, generator=gen), mesh, [Shard(0)], run_check=False
        )
        for i in range(count)
    }


def chunks(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - done) for done in range(0, length, chunk)]


def raw(
    sends: int,
    gets: int,
    chunk: int,
    *,
    duplex: bool,
    send: torch.Tensor,
    into: torch.Tensor,
    land: Path | None = None,
) -> Record:
    """``sends`` bytes to this rank's partner and ``gets`` back over plain gloo, in chunks: in
    the round's order (the ranks of node 0 send, then receive) or both directions at once."""
    from tierstore.redundancy import wire

    rank, other = dist.get_rank(), partner(dist.get_rank())
    out, back = chunks(sends, chunk), chunks(gets, chunk)
    if duplex:
        inflight = []
        landing = open(land, "wb") if land is not None else None  # noqa: SIM115 - closed below
        view = memoryview(into.numpy()) if landing is not None else None
        try:
            for i in range(max(len(out), len(back))):
                if i < len(out):
                    inflight.append(dist.isend(send[: out[i]], other))
                    while len(inflight) > wire.WINDOW:
                        inflight.pop(0).wait()
                if i < len(back):
                    dist.recv(into[: back[i]], other)
                    if landing is not None and view is not None:
                        landing.write(view[: back[i]])
            for work in inflight:
                work.wait()
            if landing is not None:
                landing.flush()
                os.fsync(landing.fileno())
        finally:
            if landing is not None:
                landing.close()
                os.unlink(land)  # type: ignore[arg-type]
        return {"received": gets}
    for src in range(WORLD):  # the plan's order: every rank's files, rank by rank
        if rank == src:
            for size in out:
                dist.send(send[:size], other)
        elif rank == partner(src):
            for size in back:
                dist.recv(into[:size], src)
    return {"received": gets}


def cold_copy(root: Path, name: str = NAME) -> Record:
    """What node 1 lost, copied back from the cold tier by its ranks (each its own share)."""
    from tierstore import Store
    from tierstore.migration.migrator import MigrationOptions
    from tierstore.migration.transfer import copy_file
    from tierstore.redundancy.records import peer_tier

    rank = dist.get_rank()
    if node_of(rank) != 1:
        return {"received": 0}
    hot, cold = dirs(root, rank)
    store = Store(hot, cold, node_local=True)
    assert store.hot is not None and store.cold is not None
    peers = peer_tier(store.hot)
    manifest = store.cold.find_manifest(name)
    assert manifest is not None, f"{name} is not in the cold tier"
    meta = manifest.metadata_file
    jobs = [(store.hot, e) for e in manifest.files_of_rank(rank) if e.path != meta]
    jobs += [(peers, e) for e in manifest.files_of_rank(partner(rank)) if e.path != meta]
    if rank == LOCAL:  # node 1's lead keeps the .metadata (its writer's node has it)
        entry = manifest.file(meta)
        assert entry is not None
        jobs.append((peers, entry))
    chunk = MigrationOptions().chunk_size
    for tier, entry in jobs:
        copy_file(store.cold, tier, manifest.name, manifest.attempt, entry, chunk_size=chunk)
    return {"received": sum(e.size for _, e in jobs)}


def lose_node(root: Path) -> None:
    """Node 1's disk is gone: its directory deleted, an empty one in its place."""
    barrier()
    if dist.get_rank() == LOCAL:
        node = root / "node1"
        shutil.rmtree(node)
        node.mkdir()
    barrier()


def run_copies(spec: dict[str, Any]) -> list[Record]:
    from torch.distributed.device_mesh import init_device_mesh

    from tierstore.format.layout import default_name
    from tierstore.redundancy import wire

    assert default_name(1) == NAME
    state = make_state(int(spec["bytes"]), init_device_mesh("cpu", (WORLD,)))
    buffers = (
        torch.randint(0, 256, (wire.CHUNK,), dtype=torch.uint8),  # what the raw runs send
        torch.empty(wire.CHUNK, dtype=torch.uint8),  # and receive into
    )
    records: list[Record] = []
    for medium in MEDIA:
        base = TMPFS if medium == "tmpfs" else Path(spec["scratch"])
        root = base / f"tierstore-bench-copies-{spec['job']}-{medium}"
        clear(root)
        try:
            records += transfers(root, medium, state, int(spec["reps"]), buffers)
            records += restores(root, medium, int(spec["reps"]))
        finally:
            clear(root)
    return records


def note(
    records: list[Record], phase: str, medium: str, variant: str, rep: int, record: Record, reps: int = 0
) -> None:
    """Keep a measurement; say it (a collective) unless it is the warm-up's (``rep`` -1)."""
    records.append({"phase": phase, "medium": medium, "variant": variant, "rep": rep, **record})
    if rep >= 0:
        _say(medium, variant, rep, reps, record)


class Rounds:
    """What one manager's checkpoint is moved by: a replication round, or raw gloo moving as
    many bytes between the same ranks."""

    def __init__(self, mgr: Any, received: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        from tierstore import Replicas
        from tierstore.redundancy.protect import Peers
        from tierstore.redundancy.records import peer_tier
        from tierstore.redundancy.schemes import Topology

        hot = mgr.store.hot  # rounds of its own, on a group of its own, beside the manager's
        group = dist.new_group(backend="gloo")
        self.peers = Peers(
            Replicas(2), Topology.of(WORLD, node_of), group, dist.get_rank(), hot, peer_tier(hot)
        )
        self.gets = received  # this rank's bytes from its partner in a round
        lengths: list[int] = [0] * WORLD
        dist.all_gather_object(lengths, received)
        self.sends = lengths[partner(dist.get_rank())]  # what its partner received from it
        self.buffers = buffers

    def protect(self) -> Record:
        manifest = self.peers.hot.find_manifest(NAME) if dist.get_rank() == 0 else None
        done = self.peers.protect(manifest)
        assert done is not None
        return {"transfer": done.seconds, "received": done.received, "copies": done.copies}

    def raw_plan(self) -> Record:
        return self._raw(duplex=False)

    def raw_duplex(self) -> Record:
        return self._raw(duplex=True)

    def raw_disk(self) -> Record:
        assert self.peers.hot is not None
        return self._raw(duplex=True, land=Path(self.peers.hot.url) / f"raw-landing-{dist.get_rank()}.bin")

    def _raw(self, *, duplex: bool, land: Path | None = None) -> Record:
        from tierstore.redundancy import wire

        send, into = self.buffers
        return raw(self.sends, self.gets, wire.CHUNK, duplex=duplex, send=send, into=into, land=land)


def transfers(
    root: Path, medium: str, state: dict[str, Any], reps: int, buffers: tuple[torch.Tensor, torch.Tensor]
) -> list[Record]:
    """A checkpoint saved with Replicas(2), then protected again and moved by raw gloo."""
    from tierstore import Replicas

    records: list[Record] = []
    mgr = manager(root, dist.get_rank(), Replicas(2))
    mgr.save(1, state, force=True)
    mgr.wait()  # committed, its copies verified on the peers, in the cold tier
    first = mgr.health().copies["rounds"][NAME]
    round_ = {"transfer": first["seconds"], "received": first["bytes"], "copies": first["copies"]}
    note(records, "copies", medium, "manager_round", -1, round_)
    moves = Rounds(mgr, first["bytes"], buffers)
    for rep in range(reps):
        for variant in rotated(TRANSFERS, rep):
            note(records, "copies", medium, variant, rep, timed(getattr(moves, variant)), reps)
    mgr.close()
    return records


def restores(root: Path, medium: str, reps: int) -> list[Record]:
    """Node 1 lost, then restored from its peers or from the cold tier."""
    records: list[Record] = []
    for rep in range(reps):
        for variant in rotated(RESTORES, rep):
            lose_node(root)
            if variant == "peers":
                note(records, "restore", medium, "peers", rep, started(root), reps)
                # nothing lost now: what a start costs anyway
                note(records, "restore", medium, "start", rep, started(root), reps)
            else:
                note(records, "restore", medium, "cold", rep, timed(partial(cold_copy, root)), reps)
    return records


def started(root: Path) -> Record:
    """A manager started with ``Replicas(2)``: its constructor (which restores what this node
    lost from the others) timed from a barrier; its ``close()`` is not."""
    from tierstore import Replicas

    barrier()
    cpu, begun = cpu_seconds(), now()
    again = manager(root, dist.get_rank(), Replicas(2))
    seconds, spent = now() - begun, cpu_seconds() - cpu
    copies = again.health().copies
    again.close()
    return {
        "seconds": seconds,
        "cpu": spent,
        "transfer": copies["restore_seconds"],
        "received": copies["restored_bytes"],
        "copies": min(copies["copies"].values(), default=0),
    }


def _say(medium: str, variant: str, rep: int, reps: int, record: Record) -> None:
    """A line of progress (a collective): the slowest rank's seconds, every rank's bytes."""
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, record)
    if dist.get_rank() != 0:
        return
    seconds = max(r["seconds"] for r in every)
    moved = sum(r.get("received") or 0 for r in every)
    rounds = [r["transfer"] for r in every if r.get("transfer") is not None]
    print(
        f"    {medium:<5} rep {rep + 1}/{reps} {variant:<10} {seconds:.3f}s"
        + (f" (rounds {max(rounds):.3f}s)" if rounds else "")
        + f"  {moved / MiB:.0f} MiB received, cpu {sum(r['cpu'] for r in every):.2f}s",
        flush=True,
    )


PHASES: dict[str, Callable[[dict[str, Any]], list[Record]]] = {"stall": run_stall, "copies": run_copies}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    assert os.environ.get("LOCAL_WORLD_SIZE") == str(LOCAL), "launch() sets the node's 2 ranks"
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    started = time.time()
    records: list[Record] = []
    for phase in spec["phases"]:
        records += PHASES[phase](spec)
    for record in records:
        record["rank"] = rank
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(records))
    if rank == 0:
        print(f"    (copies job: {time.time() - started:.0f}s on {WORLD} ranks, 2 nodes)", flush=True)
    from tests.launch import leave_cleanly

    leave_cleanly()


if __name__ == "__main__":
    main()
