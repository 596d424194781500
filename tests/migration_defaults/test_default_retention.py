"""The durable tier keeps every checkpoint unless the user gives it a policy (issue 36,
item 4): a manager given only ``cold=`` deletes nothing there, milestones included, while
the hot tier keeps its rolling window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tierstore import CheckpointManager, Retention, keep_last, list_checkpoints, prune
from tierstore.lifecycle.retention import keep_all
from tierstore.migration.migrator import MigrationOptions
from tierstore.retry import RetryPolicy
from tierstore.tiers.tier import Store

FAST = MigrationOptions(
    chunk_size=1 << 16,
    poll_interval=0.02,
    commit_timeout=30,
    retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.05),
)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(step)), "step": torch.tensor(step)}


def steps(url: str) -> list[int]:
    return sorted(c.step for c in list_checkpoints(url) if c.step is not None)


def test_a_manager_given_only_cold_keeps_every_cold_checkpoint_and_a_hot_window(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manager = CheckpointManager(hot, cold, migration=FAST)
    for step in range(1, 7):
        assert manager.save(step, state(step))
        manager.wait()  # each save's migration and prune round done: the policy ran each time
    manager.close()
    assert steps(cold) == [1, 2, 3, 4, 5, 6]
    assert steps(hot) == [5, 6]


def test_the_default_retention_is_a_hot_window_and_everything_cold() -> None:
    assert Retention().hot == keep_last(2)
    assert Retention().cold == keep_all()


def test_prune_without_a_cold_policy_deletes_nothing_cold(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    with CheckpointManager(hot, cold, migration=FAST, retention=Retention(cold=keep_all())) as manager:
        for step in range(1, 6):
            assert manager.save(step, state(step))
        manager.wait()
    reports = prune(Store(hot, cold))
    assert not any(r.deleted for r in reports)
    assert steps(cold) == [1, 2, 3, 4, 5]
