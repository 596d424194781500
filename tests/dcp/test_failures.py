"""A failed save crosses a process boundary whole (``tierstore.dcp.failures``; issue 22, item 5):
``SaveFailed`` pickles with its step and each rank's error, an error pickle cannot carry
standing in as a ``TierstoreError`` that names its type and message.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tierstore import StagingOptions
from tierstore.dcp.failures import save_failed
from tierstore.errors import CheckpointExists, SaveFailed, TierstoreError
from tierstore.manager import CheckpointManager


class NeedsTwo(Exception):
    """Pickles, but cannot be unpickled (its __init__ wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def test_save_failed_keeps_step_and_errors_through_pickle() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    class Local(RuntimeError):  # a local class: pickle cannot find it
        pass

    exists = CheckpointExists("already committed", checkpoint="step-0000000007", tier="hot /x")
    failures = {0: exists, 1: (Local("lost"), None), 2: NeedsTwo("a", "b")}
    failure = save_failed(7, CheckpointException("save failed", failures))  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(failure))
    assert type(back) is SaveFailed and str(back) == str(failure)
    assert back.step == 7 and sorted(back.errors) == [0, 1, 2]
    assert type(back.errors[0]) is CheckpointExists and str(back.errors[0]) == str(exists)
    assert back.checkpoint == "step-0000000007" and back.tier == "hot /x"
    for rank, kind, text in ((1, "Local", "lost"), (2, "NeedsTwo", "a/b")):
        stand_in = back.errors[rank]
        assert isinstance(stand_in, TierstoreError)
        assert kind in str(stand_in) and text in str(stand_in)
    assert failure.errors[1].__class__ is Local  # in process the original errors stay


def test_a_real_failed_save_pickles_with_its_step_and_errors(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "hot"), staging=StagingOptions(async_save=False))
    assert manager.save(1, {"w": torch.zeros(4)})
    with pytest.raises(SaveFailed) as raised:
        manager.save(1, {"w": torch.zeros(4)}, force=True)
    manager.close()
    back = pickle.loads(pickle.dumps(raised.value))
    assert back.step == 1 and isinstance(back.errors[0], CheckpointExists)
