"""Resolve once per job: under a process group, the coordinator alone lists the catalog and
leases the checkpoint; the other ranks read the chosen checkpoint's manifest by name, and
raise the coordinator's error when it had one (docs/design.md invariant 16).

Real gloo ranks (``tests/launch.py``), each counting its requests with a backend that
forwards every call to the local backend. This file is also the ranks' script.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest

HERE = Path(__file__).resolve()
WORLD = 3


# -- the rank side -------------------------------------------------------------------------


def _counting_backend() -> Any:
    from tierstore.format import layout
    from tierstore.storage.local import LocalBackend

    class CountingBackend(LocalBackend):
        """The local backend, counting this process's listings and lease publishes, and how
        many leases the store holds whenever a data file is read."""

        calls: ClassVar[Counter[str]] = Counter()
        leases_at_reads: ClassVar[list[int]] = []

        def __init__(self, url: str, **options: Any) -> None:
            self.path = Path(url.removeprefix("counting://"))
            super().__init__(url.replace("counting://", "file://", 1), **options)

        def list(self, prefix: str = "") -> Any:
            self.calls["list"] += 1
            return super().list(prefix)

        def publish(self, key: str, data: bytes) -> None:
            if key.startswith(layout.LEASE_DIR + "/") and key.endswith(".json"):
                self.calls["lease"] += 1
            super().publish(key, data)

        def stat(self, key: str) -> Any:
            if layout.spread_attempt_of(key) is not None:  # a data file, about to be read
                self.leases_at_reads.append(sum(1 for _ in (self.path / layout.LEASE_DIR).rglob("*.json")))
            return super().stat(key)

    return CountingBackend


def _rank_main(spec: dict[str, Any]) -> None:
    import datetime
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from helpers import blank, matches, unwrap
    from launch import leave_cleanly

    from tierstore import CheckpointManager, ReaderOptions, StagingOptions, TieredReader
    from tierstore.storage import registry

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    counting = _counting_backend()
    registry.register_backend("counting", counting, replace=True)
    hot = f"counting://{spec['hot']}"
    state, result = blank(), dict[str, Any](rank=rank)

    class SlowFollower(TieredReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            if rank == WORLD - 1:
                time.sleep(0.5)  # the others finish reading first: the lease must outlive that
            return super().read_data(plan, planner)

    try:
        if spec["mode"] == "manager":
            manager = CheckpointManager(hot, staging=StagingOptions(async_save=False))
            result["step"] = manager.load_latest(state)
            manager.close()
        elif spec["mode"] == "solo":  # rank 0 loads alone, the group initialized all the same
            if rank == 0:
                reader = TieredReader(hot)  # the default: no collective inside the load
                dcp.load(state, storage_reader=reader, no_dist=True)
                result["step"] = reader.manifest.step if reader.manifest else None
            else:
                state, result["step"] = blank(), 2  # nothing loaded; matches() below is moot
            dist.barrier()
        else:
            reader = SlowFollower(hot, options=ReaderOptions(resolve_once=spec["mode"] == "reader"))
            dcp.load(state, storage_reader=reader)
            result["step"] = reader.manifest.step if reader.manifest else None
        result["matches"] = matches(state, result["step"])
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        failures = getattr(err, "failures", {})
        result["errors"] = {
            str(r): [type(unwrap_one(f)).__name__, str(unwrap_one(f))] for r, f in failures.items()
        }
        result["error"] = type(unwrap(err)).__name__
    result["lists"] = counting.calls["list"]
    result["leases"] = counting.calls["lease"]
    result["leases_at_reads"] = counting.leases_at_reads
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    os.environ.pop("TIERSTORE_FAULTS", None)
    leave_cleanly()


def unwrap_one(failure: Any) -> BaseException:
    return failure[0] if isinstance(failure, tuple) else failure


# -- the test side -------------------------------------------------------------------------


def _run(tmp_path: Path, hot: str, mode: str) -> list[dict[str, Any]]:
    from launch import run_job

    from tierstore.testing import returns_within

    out = tmp_path / f"out-{mode}"
    out.mkdir()
    job = returns_within(
        lambda: run_job({"hot": hot, "out": str(out), "mode": mode}, WORLD, script=HERE, timeout=150),
        170,
        f"a {WORLD}-rank load ({mode})",
    )
    assert job.ok, job.describe()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture
def two_saves(tmp_path: Path) -> str:
    from helpers import save

    hot = str(tmp_path / "hot")
    save(hot, 1)
    save(hot, 2)
    return hot


@pytest.mark.parametrize("mode", ["reader", "manager"])
def test_only_the_coordinator_lists_and_leases(two_saves: str, tmp_path: Path, mode: str) -> None:
    ranks = _run(tmp_path, two_saves, mode)
    assert [(r["step"], r["matches"]) for r in ranks] == [(2, True)] * WORLD, ranks
    assert ranks[0]["lists"] >= 1 and [r["lists"] for r in ranks[1:]] == [0] * (WORLD - 1)
    assert [r["leases"] for r in ranks] == [1] + [0] * (WORLD - 1)  # one lease for the job
    # Every data file of every rank was read while exactly that one lease was held: the
    # slow last rank's reads too, though the coordinator finished reading before it.
    seen = [n for r in ranks for n in r["leases_at_reads"]]
    assert len(ranks[-1]["leases_at_reads"]) >= 1 and set(seen) == {1}, ranks
    assert not list(Path(two_saves, "leases").rglob("*.json"))  # released after the load


def test_without_resolve_once_every_rank_lists_and_leases(two_saves: str, tmp_path: Path) -> None:
    ranks = _run(tmp_path, two_saves, "per-rank")  # what the counters above would catch
    assert [r["step"] for r in ranks] == [2] * WORLD
    assert all(r["lists"] >= 1 and r["leases"] == 1 for r in ranks), ranks


def test_a_reader_by_default_lets_one_rank_load_alone_under_a_group(two_saves: str, tmp_path: Path) -> None:
    ranks = _run(tmp_path, two_saves, "solo")  # returns_within: a collective here would hang
    assert ranks[0]["step"] == 2 and ranks[0]["matches"] and ranks[0]["lists"] >= 1


def _same_error_everywhere(ranks: list[dict[str, Any]], kind: str) -> str:
    errors = ranks[0]["errors"]
    assert sorted(errors) == [str(r) for r in range(WORLD)], ranks  # each rank raised its own
    assert {tuple(e) for e in errors.values()} == {(kind, errors["0"][1])}, errors
    assert all(r["error"] == kind and r["errors"] == errors for r in ranks)
    assert [r["lists"] for r in ranks[1:]] == [0] * (WORLD - 1)
    return str(errors["0"][1])


def test_no_checkpoint_fails_every_rank_alike(tmp_path: Path) -> None:
    hot = tmp_path / "empty"
    hot.mkdir()
    message = _same_error_everywhere(_run(tmp_path, str(hot), "reader"), "CheckpointNotFound")
    assert "no committed checkpoint" in message


def test_every_candidate_damaged_fails_every_rank_alike(two_saves: str, tmp_path: Path) -> None:
    from helpers import committed, file_path, flip

    from tierstore.format import layout

    for step in (1, 2):
        flip(file_path(two_saves, committed(two_saves, step), layout.METADATA_FILE))
    message = _same_error_everywhere(_run(tmp_path, two_saves, "reader"), "ChecksumMismatch")
    assert layout.default_name(2) in message  # the newest one's error, as a single process


def test_a_single_process_resolves_as_before(two_saves: str) -> None:
    from helpers import load

    loaded, reader = load(two_saves, None)
    assert reader.manifest is not None and reader.manifest.step == 2
    assert not reader._shared and not list(Path(two_saves, "leases").rglob("*.json"))


def test_an_error_crosses_to_other_ranks_as_itself() -> None:
    from tierstore import _dist
    from tierstore.errors import CheckpointNotFound

    err = CheckpointNotFound("no committed checkpoint", tier="hot /x")
    again = _dist.Failure.of(err).rebuild()
    assert type(again) is CheckpointNotFound and str(again) == str(err) and again.tier == "hot /x"

    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")
            self.lock = threading.Lock()  # unpicklable

    stand_in = _dist.Failure.of(Odd(1, 2)).rebuild()
    assert type(stand_in) is RuntimeError and str(stand_in) == "Odd: 1/2"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))  # tests/: helpers.py, launch.py
    _rank_main(json.loads(sys.argv[1]))
