"""The manager made of parts (issue 36, item 3): one class holding its collaborators, each a
class of its own module with its own state; no mixins, no attribute bag shared between them."""

from __future__ import annotations

from pathlib import Path

import tierstore.integrations
import tierstore.manager
from tierstore import CheckpointManager, StagingOptions

PARTS = {"Group", "RunGuard", "SavePipeline", "Maintenance", "Loader", "NoticeHandler", "Delivery"}


def test_the_manager_is_one_class_that_holds_its_parts(tmp_path: Path) -> None:
    assert CheckpointManager.__mro__ == (CheckpointManager, object)  # no mixins
    with CheckpointManager(
        str(tmp_path / "hot"), staging=StagingOptions(async_save=False), preemption=False
    ) as manager:
        held = {type(value).__name__: value for value in vars(manager).values()}
        assert set(held) >= PARTS
        for name in PARTS:  # each of its own module, none a manager
            part = held[name]
            assert type(part).__mro__ == (type(part), object), name
            assert type(part).__module__.startswith("tierstore.manager."), name
        manager.save(1, {"step": 1})
        assert manager.health().saves_ok == 1 and manager.stalls.keys() == {1}


def test_no_module_of_the_manager_or_the_drop_ins_is_over_500_lines() -> None:
    for package in (tierstore.manager, tierstore.integrations):
        for module in Path(package.__file__).parent.glob("*.py"):
            lines = len(module.read_text().splitlines())
            assert lines <= 500, f"{module.name}: {lines} lines"
