"""What the suite saves and how it checks a load: state is a function of the step."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from helpers import unwrap  # noqa: F401  (re-exported for the crash tests)

from tierstore import ReaderOptions, TieredReader, TieredWriter
from tierstore.errors import IntegrityError, StorageError
from tierstore.migration.migrator import MigrationOptions
from tierstore.retry import RetryPolicy

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SHAPES = {"a": (40, 24), "b": (9,), "c": (3, 7)}
FAST = MigrationOptions(
    concurrency=1,
    chunk_size=2048,
    poll_interval=0.01,
    commit_timeout=20,
    retry=RetryPolicy(attempts=3, initial=0.001, maximum=0.01),
)
# Errors that mean "damage detected": the only acceptable outcome of loading a corrupt copy.
DETECTED = (IntegrityError, StorageError)


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    state: dict[str, Any] = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
    state["extra"] = {"step": step, "tag": f"s{step}"}
    return state


def blank() -> dict[str, Any]:
    state: dict[str, Any] = {k: torch.zeros(*shape) for k, shape in SHAPES.items()}
    state["extra"] = {"step": -1, "tag": ""}
    return state


def matches(state: dict[str, Any], step: int) -> bool:
    want = state_for(step)
    return state["extra"] == want["extra"] and all(torch.equal(state[k], want[k]) for k in SHAPES)


def load(
    hot: str | None, cold: str | None, name: str | None = None, *, lease: bool = False
) -> tuple[dict[str, Any], TieredReader]:
    target, reader = blank(), TieredReader(hot, cold, name=name, options=ReaderOptions(lease=lease))
    dcp.load(target, storage_reader=reader)
    return target, reader


def save_and_migrate(
    writer: TieredWriter, step: int, mode: str, wait: float
) -> list[tuple[str, str, str | None]]:
    """Save ``state_for(step)`` through ``writer`` (``mode`` "sync" or async "thread"), wait up
    to ``wait`` seconds for its migration, and return what the migrator reports of each job."""
    if mode == "sync":
        dcp.save(state_for(step), storage_writer=writer)
    else:
        dcp.async_save(state_for(step), storage_writer=writer).result()
    migrator = writer.migrator
    if migrator is None:
        return []
    migrator.wait(wait)
    return [(s.name, s.state.value, s.error) for s in migrator.status()]
