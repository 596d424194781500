"""Operator commands never destroy the store (issue 34, item 4): `tierstore export --force
--out` a tier's directory, one inside it or one above it exited 0 and deleted every
checkpoint; now it is refused (exit 2, naming the path and the tier) before anything is
read, and `--force` never replaces the current or home directory or a tree holding another
store's tier. `tierstore cp --to` inside or above a tier is refused the same way. Every
kind of cold tier: only a local one has a directory to protect."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cold_tiers import Cold
from helpers import load, matches, saved

from tierstore import list_checkpoints
from tierstore.dcp.export import export
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.lifecycle.scrub import verify_store
from tierstore.migration.status import migrate_pending
from tierstore.storage import faults
from tierstore.tiers.tier import Store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        cwd=cwd,
    )


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, str]:
    """Two checkpoints in a local hot tier, committed in a local cold tier too."""
    hot, cold = str(tmp_path / "data" / "hot"), str(tmp_path / "data" / "cold")
    saved(hot, 1)
    saved(hot, 2)
    assert [s.state.value for s in migrate_pending(Store(hot, cold))] == ["committed"] * 2
    return hot, cold


def intact(hot: str, cold: str) -> None:
    """Both checkpoints still committed in both tiers, and every byte of them verifies."""
    infos = list_checkpoints(Store(hot, cold))
    assert [(i.step, sorted(i.tiers)) for i in infos] == [(1, ["cold", "hot"]), (2, ["cold", "hot"])]
    checks = verify_store(Store(hot, cold))
    assert len(checks) == 8 and all(c.ok and not c.pruned for c in checks), checks


@pytest.mark.parametrize(
    ("out", "cwd", "said"),
    [
        ("{hot}", None, "is the root of the hot tier"),
        ("{hot}/checkpoints", None, "is inside the hot tier"),
        (".", "{data}", "is above the hot tier"),  # the folder the operator stands in
        ("{cold}", None, "is the root of the cold tier"),
    ],
)
def test_export_force_into_a_tier_is_refused_and_deletes_nothing(
    store: tuple[str, str], tmp_path: Path, out: str, cwd: str | None, said: str
) -> None:
    hot, cold = store
    where = {"hot": hot, "cold": cold, "data": str(tmp_path / "data")}
    args = ("export", "--hot", hot, "--cold", cold, "--format", "torch", "--force")
    proc = cli(*args, "--out", out.format(**where), cwd=Path(cwd.format(**where)) if cwd else None)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    [line] = proc.stderr.splitlines()
    assert line.startswith("tierstore export: --out ") and said in line, line
    assert "give a directory outside every tier" in line
    intact(hot, cold)


def refused(store: Store, out: str | Path) -> str:
    """What export says refusing ``out`` (nothing read, nothing written)."""
    with pytest.raises(ConfigError) as caught:
        export(store, out=out, format="torch", force=True)
    return str(caught.value)


def test_every_spelling_of_a_tier_path_is_refused(store: tuple[str, str], tmp_path: Path) -> None:
    hot, cold = store
    link = tmp_path / "link"
    link.symlink_to(hot)
    for out, said in [
        (f"{hot}/../hot", "is the root of the hot tier"),  # .. resolved
        (str(link), "is the root of the hot tier"),  # a link to it
        (f"{link}/new", "is inside the hot tier"),  # a new folder in it, through the link
        (f"{cold}/manifests", "is inside the cold tier"),
        (str(tmp_path), "is above the hot tier"),
        ("/", "is above the hot tier"),
    ]:
        assert said in refused(Store(hot, cold), out), out
    assert not Path(hot, "new").exists()
    intact(hot, cold)


def test_export_with_any_cold_tier_keeps_out_of_the_local_ones(any_cold: Cold, tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    saved(hot, 1)
    store = any_cold.store(hot)
    assert migrate_pending(store)[0].state.value == "committed"
    assert "is the root of the hot tier" in refused(store, hot)
    assert "is above the hot tier" in refused(store, tmp_path)
    if any_cold.kind == "local":
        assert "is the root of the cold tier" in refused(store, any_cold.url)
    report = export(store, out=tmp_path / "fresh", format="torch", force=True)
    assert report.files == ("state_dict.pt",)
    assert [(i.step, sorted(i.tiers)) for i in list_checkpoints(store)] == [(1, ["cold", "hot"])]


def test_force_never_replaces_where_the_operator_stands_home_or_another_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot = str(tmp_path / "store" / "hot")
    saved(hot, 1)
    work, home, other = tmp_path / "work", tmp_path / "home", tmp_path / "runs"
    for place in (work, home):
        place.mkdir()
        (place / "notes.txt").write_text("mine")
    other_hot = str(other / "run2" / "hot")  # another store's tier, two folders down
    saved(other_hot, 7)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    for out, said in [
        (".", "is the current directory or above it"),
        (str(home), "is the home directory or above it"),
        (str(other), f"holds a tierstore tier at {other_hot!r}"),
    ]:
        with pytest.raises(ConfigError, match="force") as caught:
            export(hot, out=out, format="torch", force=True)
        assert said in str(caught.value), (out, str(caught.value))
    assert (work / "notes.txt").read_text() == (home / "notes.txt").read_text() == "mine"
    assert matches(load(other_hot)[0], 7)


def held_at(point: str, gate: Path, fn: Callable[[], Any], meanwhile: Callable[[], None]) -> Any:
    """``fn()`` on a thread, held at fault ``point`` while ``meanwhile()`` runs; its result."""
    faults.arm(point, "block")
    found: list[Any] = []

    def run() -> None:
        try:
            found.append(fn())
        except BaseException as err:
            found.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not list(gate.glob(f"{point}.*.reached")):
            assert thread.is_alive() and time.monotonic() < deadline, found
            time.sleep(0.005)
        meanwhile()
    finally:
        (gate / f"{point}.release").touch()
        thread.join(60)
        faults.disarm()
    return found[0]


def test_the_out_is_checked_again_right_before_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot, out, gate = str(tmp_path / "hot"), tmp_path / "out", tmp_path / "gate"
    saved(hot, 1)
    gate.mkdir()
    monkeypatch.setenv(faults.BLOCK_DIR_ENV, str(gate))

    def someone_writes_there() -> None:  # after the first check, before the replace
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    result = held_at(
        "export.before_replace", gate, lambda: export(hot, out=out, format="torch"), someone_writes_there
    )
    assert isinstance(result, ConfigError) and "is not empty" in str(result), result
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_cp_refuses_a_destination_inside_or_above_a_tier_and_takes_the_tier_itself(
    store: tuple[str, str], tmp_path: Path
) -> None:
    hot, cold = store
    for to, said in [
        (f"{hot}/milestones", "is inside the hot tier"),
        (str(tmp_path), "is above the hot tier"),
    ]:
        proc = cli("cp", "--hot", hot, "--step", "1", "--to", to)
        assert proc.returncode == 2, (to, proc.stderr)
        assert said in proc.stderr and "give a directory outside every tier" in proc.stderr, proc.stderr
    assert not Path(hot, "milestones").exists()
    assert not Path(tmp_path, layout.MANIFEST_DIR).exists()
    same = cli("cp", "--hot", hot, "--step", "1", "--to", f"file://{hot}")  # the tier itself
    assert same.returncode == 0 and same.stdout.startswith("already there"), same.stderr
    intact(hot, cold)
