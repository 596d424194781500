"""TrainingState refuses, when it is built, an argument a save or a load could not use (issue 38,
item 1): a plain DataLoader as ``sampler=`` used to be accepted and to fail at the first save,
``save_every`` steps in, with ``AttributeError: 'DataLoader' object has no attribute
'state_dict'``. What was valid before still is."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.utils.data import DataLoader, DistributedSampler

from tierstore import CheckpointManager, ResumableLoader, ResumableSampler, StagingOptions, TrainingState
from tierstore.errors import ConfigError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DATASET = [torch.full((4,), float(i)) for i in range(16)]


def parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=10)


def test_a_plain_dataloader_as_sampler_is_refused_when_built_saying_what_to_write() -> None:
    model, optim, sched = parts()
    loader = DataLoader(DATASET, batch_size=4, shuffle=True)  # as the README's loop might read
    with pytest.raises(ConfigError) as refused:
        TrainingState(model, optim, sched, sampler=loader)
    said = str(refused.value)
    assert "TrainingState(sampler=...)" in said  # the argument
    assert "torch.utils.data.dataloader.DataLoader" in said  # the type given
    assert "has no state_dict" in said  # why
    assert "ResumableLoader or ResumableSampler" in said  # what it takes
    # what to write instead, with the loader's own batch size
    assert "ResumableLoader(dataset, batch_size=4, sampler=ResumableSampler(len(dataset)" in said


def test_a_torch_sampler_is_refused_and_told_to_use_a_resumable_one() -> None:
    model, optim, sched = parts()
    sampler = DistributedSampler(DATASET, num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError, match=r"got torch\.utils\.data\.distributed\.DistributedSampler"
    ) as refused:
        TrainingState(model, optim, sched, sampler=sampler)
    assert "A DistributedSampler keeps no position" in str(refused.value)
    assert "ResumableSampler(len(dataset), seed=...) in its place" in str(refused.value)


@pytest.mark.parametrize(
    "arguments, said",
    [
        (lambda m, o, s: (m, s), r"TrainingState\(optimizer=...\) takes a torch.optim.Optimizer.*"
         r"got torch.optim.lr_scheduler.StepLR \(it has no param_groups\)\. The LR scheduler goes third"),
        (lambda m, o, s: (o,), r"TrainingState\(model=...\) takes a torch.nn.Module.*got torch.optim.sgd.SGD"),
        (lambda m, o, s: (m, o, 0.5), r"TrainingState\(scheduler=...\) takes an LR scheduler.*got float"),
        (lambda m, o, s: (m, o, s, object()), r"TrainingState\(sampler=...\) takes the data position.*got object"),
    ],
    ids=["scheduler-as-optimizer", "optimizer-as-model", "number-as-scheduler", "object-as-sampler"],
)  # fmt: skip
def test_each_positional_argument_is_checked_when_built(arguments: Any, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        TrainingState(*arguments(*parts()))


@pytest.mark.parametrize(
    "keywords, said",
    [
        ({"extra": {"ema": 3}}, r"TrainingState\(extra\['ema'\]=...\) takes an object with state_dict\(\).*got int"),
        ({"extra": [1]}, r"TrainingState\(extra=...\) takes a mapping of names.*got list"),
        ({"options": {"full_state_dict": True}}, r"TrainingState\(options=...\) takes torch's StateDictOptions.*got dict"),
        ({"exclude": "rng"}, r"exclude takes a collection of parts, e.g. exclude=\('rng',\)"),
    ],
    ids=["extra-value", "extra-not-a-mapping", "options-as-dict", "exclude-as-string"],
)  # fmt: skip
def test_keyword_arguments_are_checked_when_built(keywords: dict[str, Any], said: str) -> None:
    model, optim, sched = parts()
    with pytest.raises(ConfigError, match=said):
        TrainingState(model, optim, sched, **keywords)


class Position:
    """Any Stateful whose state is the same on every rank: accepted as the data position."""

    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = int(state["at"])


class StatefulLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that keeps its position (torchdata's StatefulDataLoader is one)."""

    def state_dict(self) -> dict[str, int]:
        return {"batches": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_what_was_valid_stays_valid_and_saves(tmp_path: Path) -> None:
    model, optim, sched = parts()
    sampler = ResumableSampler(len(DATASET), rank=0, world_size=1, seed=1)
    valid = [
        TrainingState(model, optim, sched, sampler=ResumableLoader(DATASET, 4, sampler)),
        TrainingState(model, optim, sched, sampler=sampler, extra={"position": Position()}),
        TrainingState(model, optim, sampler=StatefulLoader(DATASET, batch_size=4)),
        TrainingState(model, [optim], options=StateDictOptions(full_state_dict=False)),
        TrainingState(model, exclude=("optim", "scheduler")),
        # A part left out is never asked for: what is passed for it is not checked.
        TrainingState(model, optim, sched, sampler=DataLoader(DATASET), exclude=("data",)),
        TrainingState(None, exclude=("model", "optim")),  # type: ignore[arg-type]
    ]
    manager = CheckpointManager(
        str(tmp_path / "hot"), staging=StagingOptions(async_save=False), preemption=False
    )
    for step, state in enumerate(valid, start=1):
        assert manager.save(step, {"train": state})
    manager.close()
