"""A hot tier that cannot be written fails when the CheckpointManager is built, saying why (issue 38,
item 1), and a save on a mount that turned read-only since says "read-only", not "no space left".
A writer option that only a TieredWriter reads is checked when the manager is built too (issue 22,
item 5).

Real mounts: a tiny tmpfs remounted read-only, where this machine lets us mount one (root in
a VM or CI; skipped elsewhere), and a real permission refusal: a process that drops root
for user nobody in front of a directory root owns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import CheckpointManager, StagingOptions, Store, WriterOptions, list_checkpoints
from tierstore.errors import ConfigError, NoSpaceLeft, SaveFailed, StorageError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

NOBODY = 65534


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: less free space than the writer's free-space margin (1 MiB), so a
    check that mistook a read-only mount for a full one would say NoSpaceLeft here."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def read_only(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)


def test_a_hot_tier_on_a_read_only_mount_is_refused_when_the_manager_is_built(small_mount: Path) -> None:
    hot = small_mount / "run1"
    hot.mkdir()
    read_only(small_mount)
    with pytest.raises(StorageError) as refused:
        CheckpointManager(str(hot), save_every=500, preemption=False)
    assert not isinstance(refused.value, NoSpaceLeft)
    said = str(refused.value)
    assert f"{hot} is on a read-only file system (EROFS)" in said
    assert "remount it read-write, or give CheckpointManager another hot directory" in said
    assert refused.value.tier == f"hot {hot}"


def test_a_hot_directory_not_made_yet_under_a_read_only_mount_is_refused_too(small_mount: Path) -> None:
    read_only(small_mount)
    with pytest.raises(StorageError, match="read-only file system"):
        CheckpointManager(str(small_mount / "not" / "made"), preemption=False)


def test_a_mount_that_turns_read_only_later_fails_the_save_as_read_only_not_full(small_mount: Path) -> None:
    hot = str(small_mount / "run1")
    manager = CheckpointManager(hot, staging=StagingOptions(async_save=False), preemption=False)
    read_only(small_mount)
    with pytest.raises(SaveFailed) as failed:
        manager.save(1, {"w": torch.arange(64.0)})
    manager.close()
    error = failed.value.errors[0]
    assert isinstance(error, StorageError) and not isinstance(error, NoSpaceLeft), repr(error)
    assert "Read-only file system" in str(error) and error.tier == f"hot {hot}"
    assert list_checkpoints(hot) == []


def test_a_hot_directory_this_user_cannot_write_is_refused_when_built(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user in front of root's directory")
    place = Path(tempfile.mkdtemp(prefix="tierstore-perm-"))  # /tmp: nobody may pass through
    try:
        place.chmod(0o755)
        hot = place / "hot"
        hot.mkdir(mode=0o755)  # root's: nobody can read it, not create files in it
        script = textwrap.dedent(
            f"""
            import os, sys, warnings
            warnings.simplefilter("ignore")
            from tierstore import CheckpointManager
            from tierstore.errors import StorageError
            # Built once as root first: every module the manager needs is imported before
            # the interpreter's own files (under /root) are out of reach.
            CheckpointManager({str(tmp_path / "warm")!r}, preemption=False).close()
            os.setgid({NOBODY}); os.setuid({NOBODY})
            try:
                CheckpointManager({str(hot)!r}, preemption=False)
            except StorageError as err:
                print("REFUSED", err.tier, "|", err)
                sys.exit(0)
            print("BUILT")
            """
        )
        ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert ran.stdout.startswith(f"REFUSED hot {hot} |"), ran.stdout + ran.stderr[-2000:]
        assert f"permission denied: user {NOBODY} cannot create files under {hot} (EACCES)" in ran.stdout
        assert "give this user write access to it" in ran.stdout
        assert not any(hot.iterdir())
    finally:
        shutil.rmtree(place, ignore_errors=True)


def test_a_writable_hot_tier_is_left_as_it_was_after_the_check(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    manager = CheckpointManager(str(hot), preemption=False)
    assert sorted(p.name for p in hot.iterdir()) == ["runs"]  # the run lock; the probe is gone
    manager.close()


def test_a_bad_writer_option_is_refused_when_the_manager_is_built(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="thread_cont"):
        WriterOptions(thread_cont=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="TIERSTORE_MAX_FILES_PER_DIR"):
        with pytest.MonkeyPatch.context() as env:  # what only a TieredWriter reads
            env.setenv("TIERSTORE_MAX_FILES_PER_DIR", "many")
            CheckpointManager(str(tmp_path / "hot"), writer=WriterOptions(thread_count=2))
    assert not (tmp_path / "hot" / "checkpoints").exists()


@pytest.mark.dist
@pytest.mark.parametrize("node_local", [False, True], ids=["shared", "node-local"])
def test_every_rank_raises_the_refusal_and_none_waits_for_a_rank_that_gave_up(
    small_mount: Path, tmp_path: Path, node_local: bool
) -> None:
    """Shared: rank 0 probes the tier for the job; node-local: each rank its own, and rank 1's
    alone is read-only here. Either way both ranks raise it when the manager is built."""
    from launch import run_job

    read_only_hot = small_mount / "run1"
    read_only_hot.mkdir()
    read_only(small_mount)
    hots = [str(tmp_path / "node0" if node_local else read_only_hot), str(read_only_hot)]
    out = tmp_path / "out"
    out.mkdir()
    cold = str(tmp_path / "cold") if node_local else None  # node-local hot tiers need one
    spec = {"hots": hots, "cold": cold, "node_local": node_local, "out": str(out)}
    job = run_job(spec, 2, script=Path(__file__), timeout=120)
    assert job.ok, job.describe()
    for rank in (0, 1):
        said = json.loads((out / f"rank{rank}.json").read_text())
        assert said["raised"] == "StorageError", said
        assert f"{read_only_hot} is on a read-only file system (EROFS)" in said["message"]
        assert said["rank"] == (1 if node_local else 0)  # the rank that found it


def _rank(spec: dict[str, Any]) -> None:
    """One rank of the two-rank job: build a manager on this rank's hot directory."""
    import torch.distributed as dist
    from launch import leave_cleanly

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    said: dict[str, Any] = {"raised": None}
    try:
        hot = spec["hots"][rank]
        CheckpointManager(Store(hot, spec["cold"], node_local=spec["node_local"]), preemption=False).close()
    except StorageError as err:
        said = {"raised": type(err).__name__, "message": str(err), "rank": err.rank}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(said))
    leave_cleanly()


if __name__ == "__main__":  # the two-rank job: run_job starts this file per rank
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: launch.py
    _rank(json.loads(sys.argv[1]))
