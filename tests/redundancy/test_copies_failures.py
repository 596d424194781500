"""The failure model of copies on other nodes (issue 37, "Failure model in the suite"), with
real processes: a copy damaged on disk or planted by someone who can write the directory is
never loaded; a node killed while replicating leaves the previous checkpoint the newest
protected one (the half-sent copies are never used, and are garbage); a peer that dies while
restoring leaves nothing half-restored that a later start would trust.

Each test can fail: take the CRC32C check out of ``FileSink.close`` and the damaged and planted
copies load; publish the protection before the round's transfers verified and the killed
round's checkpoint is picked with a rank's files missing."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
from copies_launch import JOB, LOCAL, check_resumed, lose_node, resume, save_and_kill, spec
from launch import run_job

from tierstore import Store, list_checkpoints
from tierstore.format.layout import default_name
from tierstore.lifecycle.gc import find_garbage
from tierstore.testing.faults import armed_env
from tierstore.tiers.tier import Tier

REPLICAS = ["replicas", 2]


def _attempt_dir(node: Path, step: int, *, copies: bool) -> Path:
    base = node / ("replicas/checkpoints" if copies else "checkpoints") / default_name(step)
    (attempt,) = list(base.iterdir())
    return attempt


def test_a_damaged_and_a_planted_copy_are_never_loaded(tmp_path: Path) -> None:
    cold = str(tmp_path / "cold")  # reachable here: where a file no good copy holds comes from
    saved = save_and_kill(tmp_path, 4, REPLICAS, saves=[1, 2, 3], cold=cold, drain=True)
    nodes = tmp_path / "nodes"
    kept = _attempt_dir(nodes / "node0", 3, copies=True)  # node 0 keeps node 1's copies
    damaged, planted = kept / "__2_0.distcp", kept / "__3_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside a shard
    damaged.write_bytes(bytes(data))
    older = _attempt_dir(nodes / "node1", 2, copies=False) / "__3_0.distcp"  # a valid file, wrong checkpoint
    planted.write_bytes(older.read_bytes())
    lose_node(nodes, 1)
    resumed = resume(nodes, tmp_path / "out", 4, REPLICAS, cold=cold)
    for rank, got in enumerate(resumed):
        assert (got["step"], got["digest"]) == (3, saved[3]), f"rank {rank}: not bit-exact"
    # Neither bad copy was restored or read: those two files came from the cold tier.
    assert resumed[2]["load_sources"]["__2_0.distcp"] == "cold", resumed[2]["load_sources"]
    assert resumed[3]["load_sources"]["__3_0.distcp"] == "cold", resumed[3]["load_sources"]
    restored = {p.name for p in (nodes / "node1" / "checkpoints" / default_name(3)).rglob("*.distcp")}
    assert "__2_0.distcp" not in restored and "__3_0.distcp" not in restored, restored  # never written
    bad = {"__2_0.distcp", "__3_0.distcp"}  # no good copy on any node: the cold tier's
    for got in resumed:
        others = {p: s for p, s in got["load_sources"].items() if p not in bad}
        assert "cold" not in others.values(), others  # every other file from the nodes' disks


def test_a_node_killed_while_replicating_leaves_the_previous_checkpoint_protected(tmp_path: Path) -> None:
    # Node 1's ranks die in step 3's round, after their bytes were sent but before the round
    # verified everywhere: step 3 is never published as protected; step 2 is the newest that is.
    kill = {r: armed_env("peers.after_transfer@3=kill") for r in range(LOCAL, 2 * LOCAL)}
    saved = save_and_kill(tmp_path, 4, REPLICAS, saves=[1, 2, 3], rank_env=kill, lost=(2, 3))
    nodes = tmp_path / "nodes"
    health = json.loads((tmp_path / "saved" / "health-rank0.json").read_text())
    assert default_name(3) not in health["copies"]["copies"] and health["copies"]["broken"], health
    assert not (nodes / "node0" / "replicas" / "manifests" / f"{default_name(3)}.json").exists()
    # Node 1's step-3 copies that reached node 0 are garbage (once old), never a checkpoint.
    half = {g.key for g in find_garbage(str(nodes / "node0"), grace=0.0)}
    assert any(k.startswith(f"replicas/checkpoints/{default_name(3)}/") for k in half), half
    lose_node(nodes, 1)
    resumed = resume(nodes, tmp_path / "out", 4, REPLICAS)
    check_resumed(saved, resumed, lost=1, step=2)


def test_a_peer_that_dies_while_restoring_leaves_nothing_half_restored(tmp_path: Path) -> None:
    saved = save_and_kill(tmp_path, 4, REPLICAS, saves=[1, 2])
    nodes = tmp_path / "nodes"
    lose_node(nodes, 1)
    # Node 0's rank 0 dies after its first file of the restore: the relaunch fails.
    dying = {0: armed_env("peers.flow_done@1=kill")}
    out = tmp_path / "first"
    out.mkdir()
    job = run_job(spec(nodes, REPLICAS, "resume", out), 4, rank_env=dying, timeout=300, script=JOB)
    assert not job.ok
    node1 = nodes / "node1"
    assert not list(node1.glob("replicas/manifests/*.json")), "nothing published as protected"
    for path in node1.glob("checkpoints/**/*.distcp"):  # what arrived, arrived whole and verified
        original = nodes / "node0" / "replicas" / path.relative_to(node1)
        assert path.read_bytes() == original.read_bytes(), path
    # The next start restores the rest and resumes bit-exact, nothing from the cold tier.
    resumed = resume(nodes, tmp_path / "out", 4, REPLICAS)
    check_resumed(saved, resumed, lost=1)


def test_a_preemption_notice_pushes_the_checkpoint_to_the_peers_within_the_grace_period(
    tmp_path: Path,
) -> None:
    # SIGTERM on rank 1; the cold tier is down: the save on the notice is protected by its
    # copies before the grace period ends, close() says so, and losing a node after the
    # preemption costs nothing.
    out = tmp_path / "saved"
    out.mkdir()
    grace = 10.0
    job = run_job(
        spec(tmp_path / "nodes", REPLICAS, "preempt", out, at=3, grace=grace), 4, timeout=300, script=JOB
    )
    assert job.ok, job.describe()
    reports = [json.loads((out / f"preempted-rank{r}.json").read_text()) for r in range(4)]
    stopped = reports[0]["step"]
    assert stopped is not None and all(r["step"] == stopped for r in reports), reports
    assert all(r["copies"]["copies"][default_name(stopped)] == 2 for r in reports), reports
    assert "2 verified copies" in reports[0]["close"], reports[0]["close"]  # MigrationFailed names them
    assert reports[1]["seconds_since_signal"] < grace, reports[1]
    saved = {int(k): v for k, v in json.loads((out / "saved.json").read_text()).items()}
    lose_node(tmp_path / "nodes", 1)
    resumed = resume(tmp_path / "nodes", tmp_path / "out", 4, REPLICAS)
    check_resumed(saved, resumed, lost=1, step=stopped)


def test_a_checkpoint_the_cold_tier_never_got_reaches_it_from_the_restored_node(tmp_path: Path) -> None:
    # The cold tier is down while the job saves (a file where its directory should be); node 1
    # is lost. The relaunch, with the cold tier back, rebuilds node 1 from its peer and the
    # migration every rank resumes at start uploads node 1's files from the rebuilt copy: the
    # cold tier ends up with whole checkpoints none of whose node-1 files survived on node 1.
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cold tier's directory should be")
    cold = str(blocked / "cold")
    saved = save_and_kill(tmp_path, 4, REPLICAS, saves=[1, 2], cold=cold)
    nodes = tmp_path / "nodes"
    lose_node(nodes, 1)
    blocked.unlink()
    blocked.mkdir()
    resumed = resume(nodes, tmp_path / "out", 4, REPLICAS, cold=cold, close_timeout=60)
    assert all(r["digest"] == saved[2] for r in resumed)
    in_cold = {c.step: c for c in list_checkpoints(Store(cold=cold))}
    assert set(in_cold) == {1, 2}, in_cold  # both committed in cold by the relaunch
    tier = Tier("cold", cold)
    for step in (1, 2):  # and whole: every rank's files, node 1's from its rebuilt copies
        manifest = tier.find_manifest(default_name(step))
        assert manifest is not None and {f.rank for f in manifest.files} >= {2, 3}
        for entry in manifest.files:
            path = Path(cold) / tier.file_key(manifest.name, manifest.attempt, entry.path)
            assert path.stat().st_size == entry.size and crc32c.crc32c(path.read_bytes()) == entry.crc32c
