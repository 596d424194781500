"""A full disk while writing a shard and while publishing the manifest: a clear error that
names tier and key, the previous checkpoint intact and newest, debris removed by GC."""

from __future__ import annotations

import subprocess
from pathlib import Path

import model
import pytest
import torch.distributed.checkpoint as dcp
from stats import STATS

from tierstore import TieredWriter, WriterOptions, list_checkpoints
from tierstore.errors import NoSpaceLeft
from tierstore.format import layout
from tierstore.lifecycle.gc import collect_garbage, find_garbage
from tierstore.storage import faults
from tierstore.storage.local import LocalBackend


def save(hot: str, step: int) -> None:
    dcp.save(model.state_for(step), storage_writer=TieredWriter(hot, step=step))


def failed_save(hot: str, step: int) -> BaseException:
    with pytest.raises(BaseException) as info:
        save(hot, step)
    return model.unwrap(info.value)


@pytest.mark.parametrize("point, hit", [("local.write", 1), ("local.write", 2), ("local.publish.write", 1)])
def test_enospc_mid_save(tmp_path: Path, point: str, hit: int) -> None:
    hot = str(tmp_path / "hot")
    save(hot, 1)
    faults.arm(point, "enospc", hit=hit)
    STATS.faults += 1
    err = failed_save(hot, 2)
    faults.disarm()
    assert isinstance(err, NoSpaceLeft), err
    assert "no space left" in str(err) and err.tier.startswith("hot ") and err.key
    assert [c.step for c in list_checkpoints(hot)] == [1]
    target, _ = model.load(hot, None)
    assert model.matches(target, 1)
    collect_garbage(hot, grace=0, dry_run=False)
    assert find_garbage(hot, grace=0) == []
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(2))).exists()
    assert not any(p.name.startswith(".") for p in Path(hot, layout.MANIFEST_DIR).iterdir())
    save(hot, 2)  # space is back: saving works again
    assert [c.step for c in list_checkpoints(hot)] == [1, 2]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 16 MiB tmpfs, where this machine lets us mount one (root in a VM or CI)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_save_that_cannot_fit_fails_before_writing(tiny_disk: Path) -> None:
    hot = str(tiny_disk / "hot")
    save(hot, 1)
    huge = {"big": model.torch.zeros(4 << 20)}  # 16 MiB: more than is left
    with pytest.raises(BaseException) as info:
        dcp.save(huge, storage_writer=TieredWriter(hot, step=2))
    err = model.unwrap(info.value)
    assert isinstance(err, NoSpaceLeft) and "nothing was written" in str(err), err
    assert not Path(hot, layout.checkpoint_prefix(layout.default_name(2))).exists()
    assert [c.step for c in list_checkpoints(hot)] == [1]


def test_real_enospc_mid_write(tiny_disk: Path, monkeypatch) -> None:
    hot = str(tiny_disk / "hot")
    save(hot, 1)
    monkeypatch.setattr(LocalBackend, "free_bytes", lambda self: None)  # skip the early check
    with pytest.raises(BaseException) as info:
        dcp.save({"big": model.torch.zeros(5 << 20)}, storage_writer=TieredWriter(hot, step=2))
    err = model.unwrap(info.value)
    assert isinstance(err, NoSpaceLeft), err
    assert [c.step for c in list_checkpoints(hot)] == [1]
    target, _ = model.load(hot, None)
    assert model.matches(target, 1)
    collect_garbage(hot, grace=0, dry_run=False)
    assert find_garbage(hot, grace=0) == []


@pytest.mark.parametrize("encoding", ["dcp", "raw"])
def test_enospc_inside_torch_save_is_reported_as_no_space(tmp_path: Path, encoding: str) -> None:
    # Regression (found by the real-tmpfs test): a tensor larger than the local writer's
    # 64 KiB write buffer hits the disk inside torch.save, whose C++ writer turned our
    # NoSpaceLeft into "RuntimeError: unexpected pos". Injected here so it runs anywhere;
    # the raw encoding writes the tensor's memory itself, and must say the same.
    hot = str(tmp_path / "hot")
    faults.arm("local.write", "enospc")
    with pytest.raises(BaseException) as info:
        dcp.save(
            {"big": model.torch.zeros(1 << 18)},
            storage_writer=TieredWriter(hot, step=1, options=WriterOptions(encoding=encoding)),
        )
    faults.disarm()
    err = model.unwrap(info.value)
    assert isinstance(err, NoSpaceLeft) and "__0_0.distcp" in str(err), repr(err)
