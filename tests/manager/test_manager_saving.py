"""What ``CheckpointManager.save`` refuses before it writes anything (issue 22, item 5): a step
no manifest can record is a ConfigError, not a failed save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import CheckpointManager, Retention
from tierstore.errors import ConfigError
from tierstore.format.manifest_format import MAX_STEP


def test_the_manager_refuses_a_step_no_manifest_can_record_before_writing(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path / "hot"), retention=Retention(hot_min_free=None)) as manager:
        with pytest.raises(ConfigError, match="2\\*\\*62"):
            manager.save(MAX_STEP + 1, {"w": torch.zeros(4)})
        assert manager.health().saves_failed == 0  # refused, not a failed save
    assert not (tmp_path / "hot" / "checkpoints").exists()
