"""Saving on a preemption notice: ``python -m benchmarks.jobs.preemption SPEC.json OUT.json``.

One process (no process group), a state of ``bytes`` (16 MiB float32 tensors), a
``CheckpointManager`` with the default staging (``dcp.async_save``, reused buffers) and a
cadence that never saves on its own, with a cold tier of each kind in ``spec["colds"]`` (a
local directory; the moto S3 server the driver started). Each rep, per cold tier:

* **sync**: the baseline, a plain ``dcp.save`` through ``TieredWriter`` into the same tiers
  (``CheckpointManager(staging=StagingOptions(async_save=False)).save(force=True)``): wall time
  to the hot commit;
* **notice**: the process sends itself SIGTERM, then the loop's next ``save()`` acts on it:
  from the signal to the hot commit (``PreemptionReport.hot_seconds``), to the end of the push
  to the cold tier (``cold_seconds``), and the share of the grace period left;
* **notice_in_flight**: the same with a cadence save's ``dcp.async_save`` started just
  before the signal, so the notice's save first waits for that flush.

Each kind of save runs right after the other in a rep (order alternating by rep); the
driver reports best of reps and the spread, with the ratio of notice to sync.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import MiB, Record, now
from tierstore import CheckpointManager, PreemptionOptions, Retention, StagingOptions, Store

TENSOR = 16 * MiB
KINDS = ("sync", "notice", "notice_in_flight")


def state_of(size: int, step: int) -> dict[str, Any]:
    count = max(1, size // TENSOR)
    return {f"t{i}": torch.full((TENSOR // 4,), float(step + i)) for i in range(count)}


def one(kind: str, hot: Path, cold: dict[str, Any], size: int, grace: float, rep: int) -> Record:
    record: Record = {"variant": f"{kind}@{cold['kind']}", "rep": rep, "bytes": size}
    url, options = cold["url"] + f"/{kind}-{rep}", cold.get("options")
    retention = Retention(hot_min_free=None)
    if kind == "sync":
        sync = StagingOptions(async_save=False)
        with CheckpointManager(
            Store(str(hot), url, cold_options=options), staging=sync, retention=retention, preemption=False
        ) as manager:
            state = state_of(size, 1)
            start = now()
            manager.save(1, state, force=True)
            record["commit"] = now() - start
            manager.wait()  # its migration, untimed: the next measurement starts clean
        return record
    manager = CheckpointManager(
        Store(str(hot), url, cold_options=options),
        save_every=10**9,
        retention=retention,
        preemption=PreemptionOptions(grace_seconds=grace),
    )
    try:
        state = state_of(size, 2)
        if kind == "notice_in_flight":
            manager.save(1, state_of(size, 1), force=True)  # returns once staged; flushing now
        os.kill(os.getpid(), signal.SIGTERM)
        manager.save(2, state)
        report = manager.preemption
        assert report is not None and manager.preempted
        record.update(
            commit=report.hot_seconds,
            cold=report.cold_seconds,
            cold_state=report.cold,
            left=report.seconds_left,
            grace=grace,
        )
    finally:
        manager.close()
    return record


def run(spec: dict[str, Any]) -> dict[str, Any]:
    logging.getLogger("tierstore").setLevel(logging.ERROR)  # each notice logs at WARNING
    scratch = Path(spec["scratch"])
    records = []
    try:
        for rep in range(spec["reps"]):
            for cold in spec["colds"]:
                order = KINDS if rep % 2 == 0 else tuple(reversed(KINDS))
                for kind in order:
                    hot = scratch / f"hot-{cold['kind']}-{kind}-{rep}"
                    record = one(kind, hot, cold, spec["bytes"], spec["grace"], rep)
                    records.append(record)
                    print(
                        f"    rep {rep + 1}/{spec['reps']} {record['variant']:<28} "
                        f"hot {record['commit']:6.3f}s"
                        + (
                            f"  cold {record['cold']:6.3f}s  left {record['left']:5.1f}s"
                            if "cold" in record
                            else ""
                        ),
                        flush=True,
                    )
                    shutil.rmtree(hot, ignore_errors=True)
                    time.sleep(0.2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"bytes": spec["bytes"], "reps": spec["reps"], "grace": spec["grace"], "records": records}


if __name__ == "__main__":
    module_main(run)
