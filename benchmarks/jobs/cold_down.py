"""Saves with the cold tier down: ``python -m benchmarks.jobs.cold_down SPEC.json OUT.json``.

One process (no process group), a state of ``bytes`` saved by ``TieredWriter`` with an S3
cold tier behind the test suite's fault proxy (``backends/s3/tests/s3_fault_proxy.py``,
one proxy process per mode, so its threads never share this process's GIL): healthy,
refusing connections, stalled (accepts, never answers) or denying writes. Each save is
paired with a hot-only save (no cold tier) of the same kind right before or after it (the
order alternates by rep): ``dcp.save`` wall and CPU time, ``dcp.async_save``'s stall and
time to commit. The cold tier gets the S3 tier's default timeouts and retries, as a user
would have them.

Between measurements the healthy cold tier's migrations are drained and every save gets
a short pause (untimed): in training, saves are minutes apart, so an upload or a failed
upload's clean-up of the previous save never overlaps the next one. A migrator failing
against a down tier keeps retrying in the background meanwhile, as it would in training.
Once every measurement is written out the process ends without waiting for those retries.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.infra.launch import ROOT, module_main
from benchmarks.infra.measure import MiB, Record, cpu_seconds, now
from benchmarks.infra.servers import REGION, ServerProcess

PROXY = ROOT / "backends" / "s3" / "tests" / "s3_fault_proxy.py"
MODES = ("healthy", "refuse", "stall", "deny_writes")
KINDS = ("sync", "async")
GIVE_UP = 60.0  # seconds: a save this slow is blocked on the cold tier; its later reps are skipped
SETTLE = 0.5  # seconds between measurements (untimed), see the module docstring


def label(kind: str, mode: str | None, against: str) -> str:
    """A case: ``mode`` None is the hot-only save paired with mode ``against``."""
    return f"{kind}@{mode}" if mode else f"{kind}@hot_only/{against}"


class Bench:
    def __init__(self, spec: dict[str, Any], proxies: dict[str, ServerProcess]) -> None:
        self.spec = spec
        self.proxies = proxies
        self.scratch = Path(spec["scratch"])
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.broken: dict[str, str] = {}
        self.migrators: dict[str, Any] = {}  # per case, to report what they recorded

    def migrations(self) -> dict[str, dict[str, int]]:
        """Per case: the migration states its migrator recorded (failed ones are reported,
        never raised into the save)."""
        out: dict[str, dict[str, int]] = {}
        for name, migrator in self.migrators.items():
            if migrator is not None:
                for status in migrator.status():
                    states = out.setdefault(name, {})
                    states[status.state.value] = states.get(status.state.value, 0) + 1
        return out

    def writer(self, name: str, mode: str | None, step: int) -> Any:
        from tierstore import Store, TieredWriter

        hot = str(self.scratch / name.replace("/", "-"))  # one store (and migrator) per case
        if mode is None:
            return TieredWriter(hot, step=step)
        options = {
            "endpoint_url": self.proxies[mode].url,
            "key": "testing",
            "secret": "testing",
            "region": REGION,
        }
        return TieredWriter(
            Store.of(hot, f"s3://{self.spec['bucket']}/{name}", cold_options=options), step=step
        )

    def save(self, kind: str, mode: str | None, against: str, state: dict[str, Any], step: int) -> Record:
        name = label(kind, mode, against)
        writer = self.writer(name, mode, step)
        self.migrators[name] = writer.migrator
        cpu, start = cpu_seconds(), now()
        if kind == "sync":
            dcp.save(state, storage_writer=writer)
            stall = commit = now() - start
        else:
            future = dcp.async_save(state, storage_writer=writer, async_stager=self.stager)
            stall = now() - start
            future.result()  # type: ignore[union-attr]
            commit = now() - start
        record: Record = {"stall": stall, "commit": commit, "cpu": cpu_seconds() - cpu}
        if mode == "healthy" and writer.migrator is not None:
            writer.migrator.wait(600)  # untimed: the next save starts with no upload running
        return record

    def measure(self, kind: str, mode: str | None, against: str, state: dict[str, Any], rep: int) -> Record:
        name = label(kind, mode, against)
        record: Record = {
            "variant": name,
            "kind": kind,
            "mode": mode or "hot_only",
            "against": against,
            "rep": rep,
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        }
        try:
            record.update(self.save(kind, mode, against, state, rep + 1))
        except (Exception, CheckpointException) as err:
            record["error"] = f"{type(err).__name__}: {err}"[:2000]
        if record.get("error") or record.get("commit", 0) > GIVE_UP:
            self.broken.setdefault(name, record.get("error") or f"took {record['commit']:.0f}s")
        return record


def run(spec: dict[str, Any]) -> dict[str, Any]:
    # The migrators of the down tiers still retry when this process is done: not waited for.
    os.environ["TIERSTORE_EXIT_WAIT"] = "0"
    # Their retries and failures would log a line each; the output counts them instead.
    for name in ("tierstore", "tierstore_s3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    count = max(1, spec["bytes"] // (16 * MiB))
    gen = torch.Generator().manual_seed(11)
    state = {f"layers.{i:03d}.weight": torch.rand(16 * MiB // 4, generator=gen) for i in range(count)}
    proxies = {mode: ServerProcess([str(PROXY), spec["endpoint"], mode]) for mode in MODES}
    records: list[Record] = []
    bench = Bench(spec, proxies)
    try:
        bench.stager.stage(state)  # staging buffers allocated once, as in a long run
        tiny = {"w": torch.rand(1024)}
        for against in MODES:  # warm-up: imports, clients, connection pools, migrators
            for kind in KINDS:
                for mode in (None, against):
                    bench.measure(kind, mode, against, tiny, -1)
        for rep in range(spec["reps"]):
            shift = rep % len(MODES)
            for against in MODES[shift:] + MODES[:shift]:
                for kind in KINDS:
                    pair: list[str | None] = [None, against] if rep % 2 == 0 else [against, None]
                    for mode in pair:
                        if label(kind, mode, against) in bench.broken:
                            continue
                        record = bench.measure(kind, mode, against, state, rep)
                        records.append(record)
                        _say(record, spec["reps"])
                        time.sleep(SETTLE)
        bench.stager.close()
        migrations = bench.migrations()
    finally:
        for proxy in proxies.values():
            proxy.stop()
        shutil.rmtree(spec["scratch"], ignore_errors=True)
    return {
        "bytes": records[0]["bytes"] if records else spec["bytes"],
        "reps": spec["reps"],
        "records": records,
        "broken": bench.broken,
        "migrations": migrations,
    }


def _say(record: Record, reps: int) -> None:
    head = f"    rep {record['rep'] + 1}/{reps} {record['variant']:<26}"
    if record.get("error"):
        print(f"{head} ERROR {record['error'][:200]}", flush=True)
    else:
        print(
            f"{head} stall {record['stall']:6.3f}s  commit {record['commit']:6.3f}s  "
            f"cpu {record['cpu']:6.3f}s",
            flush=True,
        )


def main() -> None:
    module_main(run)
    sys.stdout.flush()
    # Uploads to the down tiers are still retrying on pool threads that interpreter exit
    # would join (concurrent.futures); the results are written, so leave now.
    os._exit(0)


if __name__ == "__main__":
    main()
