"""Quarantine only what is proven gone (issue 34, item 3).

One transient 404 from the cold tier (eventually consistent S3-compatibles and misrouting
proxies answer them) must neither quarantine the newest good checkpoint nor roll the job
back: a missing object counts only once a second request and the tier's listing agree, a
corrupt copy only once a second verified read fails, and a tier's copy is quarantined only
where its damage is proven. And a quarantine record never outweighs a published manifest:
`tierstore quarantine --delete` never deletes the data of the attempt committed now, and a
re-run `--restore` finishes one interrupted between its publish and its record delete.

The 404s are real answers on the wire: the S3 fault proxy (or one in front of
fake-gcs-server) answers them for the keys a test names; for a local tier, a local backend
registered under a test scheme answers them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import pytest
import torch
from cold_tiers import Cold
from helpers import blank, file_path, flip, load, matches, saved, unwrap
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import CheckpointManager, Retention, keep_last, list_checkpoints
from tierstore.cli import main
from tierstore.errors import (
    CheckpointExists,
    ChecksumMismatch,
    FaultInjected,
    IntegrityError,
    InvalidManifest,
    ObjectNotFound,
    TransientStorageError,
)
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.lifecycle.prune import prune_tier
from tierstore.lifecycle.quarantine import (
    delete_quarantined,
    list_quarantined,
    prove_damage,
    quarantine,
    quarantine_proven,
    restore_quarantined,
)
from tierstore.migration.migrator import MigrationOptions
from tierstore.retry import RetryPolicy
from tierstore.storage import faults
from tierstore.storage.backend import ObjectInfo
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Store, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends" / "gcs" / "tests"))

FAST = MigrationOptions(
    chunk_size=1 << 16,
    poll_interval=0.02,
    commit_timeout=30,
    retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.05),
)
DATA = layout.data_file_name(0, 0)


# -- a local tier that answers 404 for keys that are there ------------------------------


@dataclass
class Rule:
    key: str
    ops: tuple[str, ...]
    times: int
    fired: int = 0


@dataclass
class Armed:
    rules: list[Rule] = field(default_factory=list)

    def fire(self, op: str, key: str, tier: str) -> None:
        for rule in self.rules:
            if rule.key == key and op in rule.ops and rule.fired < rule.times:
                rule.fired += 1
                raise ObjectNotFound(
                    "no such object (a 404 answered for a key that is there)", key=key, tier=tier
                )


ARMED = Armed()


class Answers404(LocalBackend):
    """A local tier whose reads of an armed key answer 404 while the key is there."""

    scheme = "answers404"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url.replace("answers404://", "file://", 1), **options)

    def stat(self, key: str) -> ObjectInfo:
        ARMED.fire("stat", key, self.label)
        return super().stat(key)

    def open_read(self, key: str) -> BinaryIO:
        ARMED.fire("read", key, self.label)
        return super().open_read(key)

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        ARMED.fire("read", key, self.label)
        return super().open_range(key, offset, length)


@pytest.fixture
def answers404(registered_backend: Callable[[str, type], None]) -> Iterator[Armed]:
    registered_backend("answers404", Answers404)
    ARMED.rules.clear()
    yield ARMED
    ARMED.rules.clear()


# -- the same, on the wire of every cold tier kind ---------------------------------------


@dataclass
class Faulty:
    """A cold tier as the product sees it, and a way to make it answer 404 for a key."""

    cold: Cold
    arm: Callable[[str], Callable[[], int]]  # key -> how often its 404 was answered


@contextmanager
def answering_404(cold: Cold, request: pytest.FixtureRequest) -> Iterator[Faulty]:
    """``cold``, reached so that one GET of an armed key answers 404 (then the truth)."""
    if cold.kind == "local":
        faulty = dataclasses.replace(cold, url=f"answers404://{cold.url}")

        def arm_local(key: str) -> Callable[[], int]:
            rule = Rule(key, ("read",), times=1)
            ARMED.rules.append(rule)
            return lambda: rule.fired

        request.getfixturevalue("answers404")
        yield Faulty(faulty, arm_local)
        return
    if cold.kind in ("s3", "s3-slow"):
        from s3_fault_proxy import FaultProxy

        # In front of the latency proxy, if any: its delay rule matches every request first.
        upstream = cold.proxy.url if cold.proxy is not None else request.getfixturevalue("s3_endpoint")
        proxy = FaultProxy(upstream)

        def arm_s3(key: str) -> Callable[[], int]:
            rule = proxy.add("not_found", method="GET", contains=(key,))
            return lambda: rule.fired

        try:
            yield Faulty(
                dataclasses.replace(cold, options={**cold.options, "endpoint_url": proxy.url}), arm_s3
            )
        finally:
            proxy.close()
        return
    from gcs_fault_proxy import FaultProxy as GCSProxy

    gcs = GCSProxy(request.getfixturevalue("gcs_endpoint")).start()
    prefix = cold.url.split("/", 3)[3]

    def arm_gcs(key: str) -> Callable[[], int]:
        gcs.inject(404, method="GET", match=quote(f"{prefix}/{key}", safe=""))
        return lambda: len(gcs.actions("404"))

    try:
        yield Faulty(dataclasses.replace(cold, options={**cold.options, "endpoint_url": gcs.url}), arm_gcs)
    finally:
        gcs.stop()


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 16, generator=g), "step": torch.tensor(step)}


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(1 << 16), "step": torch.tensor(-1)}


def manager(hot: str, cold: Cold | None = None) -> CheckpointManager:
    retention = Retention(hot_min_free=None)
    if cold is None:
        return CheckpointManager(hot, retention=retention)
    return CheckpointManager(
        Store(hot, cold.url, cold_options=cold.options), migration=FAST, retention=retention
    )


def damage_hot_copy(hot: str, name: str) -> None:
    tier = Tier("hot", hot)
    manifest = tier.find_manifest(name)
    assert manifest is not None
    flip(Path(hot) / tier.file_key(name, manifest.attempt, DATA))


# -- a resume never takes one 404 for damage ----------------------------------------------


def test_a_transient_404_from_the_cold_tier_neither_quarantines_nor_rolls_back(
    any_cold: Cold, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    hot = str(tmp_path / "hot")
    with answering_404(any_cold, request) as faulty:
        run = manager(hot, faulty.cold)
        for step in (1, 2):
            run.save(step, state(step))
        run.close()
        newest = layout.default_name(2)
        committed = any_cold.tier.find_manifest(newest)
        assert committed is not None
        # The hot copy of a shard is bad (found by the verified read), so the cold copy is
        # the one to read, and the cold tier answers its first GET with a 404.
        damage_hot_copy(hot, newest)
        answered = faulty.arm(any_cold.tier.file_key(newest, committed.attempt, DATA))
        again = manager(hot, faulty.cold)
        target = empty()
        assert again.load_latest(target) == 2, "rolled back a step on one 404"
        assert torch.equal(target["w"], state(2)["w"])
        assert answered() == 1  # the 404 was answered, and the resume read past it
        assert again.health().quarantined == ()
        again.close()
    store = Store(hot, any_cold.url, cold_options=any_cold.direct_options)
    assert list_quarantined(store) == []
    assert 2 in [c.step for c in list_checkpoints(store)]
    assert any_cold.tier.find_manifest(newest) == committed  # still committed in cold


def test_a_404_the_listing_contradicts_stops_the_resume_and_quarantines_nothing(
    answers404: Armed, tmp_path: Path
) -> None:
    """A proxy that always answers 404 for one key the tier lists: the resume raises what
    happened (naming file, checkpoint and tier), steps back past nothing, sets nothing aside."""
    hot = f"answers404://{tmp_path / 'hot'}"
    saved(hot, 1)
    newest = saved(hot, 2)
    tier = Tier("hot", hot)
    answers404.rules.append(Rule(tier.file_key(newest.name, newest.attempt, DATA), ("stat", "read"), 10**6))
    run = manager(hot)
    with pytest.raises(CheckpointException) as raised:
        run.load_latest(blank())
    error = unwrap(raised.value)
    assert isinstance(error, TransientStorageError), error
    assert "404" in str(error) and "not damage" in str(error)
    assert (error.checkpoint, error.file) == (newest.name, DATA) and error.tier is not None
    assert run.health().quarantined == ()
    run.close()
    assert list_quarantined(Store(hot)) == []
    assert [c.step for c in list_checkpoints(hot)] == [1, 2]


def test_a_file_gone_for_good_is_still_quarantined(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    saved(hot, 1)
    newest = saved(hot, 2)
    file_path(hot, newest).unlink()
    with manager(hot) as run:
        target = blank()
        assert run.load_latest(target) == 1 and matches(target, 1)
        assert run.health().quarantined == (newest.name,)
    [aside] = list_quarantined(Store(hot))
    assert aside.attempt == newest.attempt
    assert "listing agree" in aside.reason and DATA in aside.reason  # why, and which file


# -- a tier's copy is quarantined only where its damage is proven -------------------------


def test_only_a_copy_proven_damaged_in_its_tier_is_quarantined(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    newest = saved(hot, 2, cold, migrated=True)
    hot_tier, cold_tier = Tier("hot", hot), Tier("cold", cold)
    in_cold = cold_tier.find_manifest(newest.name)
    assert in_cold is not None and in_cold.attempt == newest.attempt
    flip(file_path(hot, newest))
    mismatch = ChecksumMismatch.crc32c(1, 2, checkpoint=newest.name, file=DATA, tier=hot_tier.label)
    assert isinstance(prove_damage(hot_tier, newest, [mismatch]), ChecksumMismatch)
    assert prove_damage(cold_tier, in_cold, [mismatch]) is None  # the cold copy reads verified
    assert not quarantine_proven(cold_tier, in_cold, "a resume said so", [mismatch])
    assert cold_tier.find_manifest(newest.name) == in_cold and list_quarantined(Store(cold)) == []
    # A 404 the tier's listing contradicts proves nothing; one it confirms does.
    gone = ObjectNotFound("no such object", checkpoint=newest.name, file=DATA, tier=cold_tier.label)
    assert prove_damage(cold_tier, in_cold, [gone]) is None
    file_path(cold, in_cold).unlink()
    assert isinstance(prove_damage(cold_tier, in_cold, [gone]), ObjectNotFound)
    assert quarantine_proven(cold_tier, in_cold, "a resume said so", [gone])
    assert [q.attempt for q in list_quarantined(Store(cold))] == [newest.attempt]
    assert hot_tier.find_manifest(newest.name) == newest  # nothing asked of the hot tier


def test_a_manifest_part_answered_404_once_is_read_again(answers404: Armed, tmp_path: Path) -> None:
    manifest = two_level()
    Tier("hot", f"answers404://{tmp_path / 'hot'}").publish_manifest(manifest)
    tier = Tier("hot", f"answers404://{tmp_path / 'hot'}")  # nothing cached: parts read from the tier
    part = tier.file_key(manifest.name, manifest.attempt, manifest.parts[1].path)
    once = Rule(part, ("read",), times=1)
    answers404.rules.append(once)
    found = tier.find_manifest(manifest.name)
    assert found is not None and found.files == manifest.files and once.fired == 1
    answers404.rules[:] = [Rule(part, ("read",), times=10**6)]  # listed, but always a 404
    found = Tier("hot", tier.url).find_manifest(manifest.name)
    assert found is not None
    with pytest.raises(TransientStorageError, match="404 twice but is listed"):
        _ = found.files
    answers404.rules.clear()
    (tmp_path / "hot" / part).unlink()
    found = Tier("hot", tier.url).find_manifest(manifest.name)
    assert found is not None
    with pytest.raises(InvalidManifest, match="part 1 is missing"):
        _ = found.files


def test_a_manifest_part_is_proven_missing_in_the_tier_that_lacks_it(tmp_path: Path) -> None:
    manifest = two_level()
    for root in ("hot", "cold"):
        Tier(root, str(tmp_path / root)).publish_manifest(manifest)
    part = Tier("hot", str(tmp_path / "hot")).file_key(
        manifest.name, manifest.attempt, manifest.parts[1].path
    )
    (tmp_path / "hot" / part).unlink()
    failure = InvalidManifest("invalid manifest: part 1 is missing", checkpoint=manifest.name)
    for root, proven in (("hot", True), ("cold", False)):
        tier = Tier(root, str(tmp_path / root))
        here = tier.find_manifest(manifest.name)
        assert here is not None
        assert isinstance(prove_damage(tier, here, [failure]), InvalidManifest) is proven, root


def two_level(world: int = 6) -> Manifest:
    files = [FileEntry(".metadata", 900, 0xDEADBEEF, 0)] + [
        FileEntry(f"__{rank}_0.distcp", 1000 + rank, rank * 7, rank) for rank in range(world)
    ]
    return Manifest(
        name="step-0000000010",
        step=10,
        attempt="20261203T090000Z-3fa2b1c4",
        world_size=world,
        created=1795940907.25,
        files=tuple(files),
        producer="tierstore test",
        encoding="raw",
        part_ranks=2,
    )


# -- a record never outweighs the published manifest --------------------------------------


def record_for(tier: Tier, manifest: Manifest) -> None:
    """A quarantine record of ``manifest`` (a planted one, or what a resume wrote)."""
    body = {"manifest": manifest.to_json().decode(), "reason": "planted", "when": 0}
    tier.backend.publish(layout.quarantine_key(manifest.name, manifest.attempt), json.dumps(body).encode())


def test_delete_never_deletes_the_data_of_the_committed_attempt(
    hot_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(hot_dir, 1)
    live = saved(hot_dir, 2)
    record_for(Tier("hot", hot_dir), live)  # a record planted for the live attempt
    for dry in (True, False):
        with pytest.raises(CheckpointExists, match="refusing to delete"):
            delete_quarantined(Store(hot_dir), live.name, dry_run=dry)
    assert main(["quarantine", "--hot", hot_dir, "--delete", live.name, "--yes"]) == 1
    said = capsys.readouterr().err
    assert "refusing to delete" in said and "nothing was deleted" in said
    assert f"tierstore quarantine --restore {live.name}" in said  # what to do instead
    assert file_path(hot_dir, live).exists()
    state, _ = load(hot_dir, name=live.name)
    assert matches(state, 2)


def test_a_rerun_restore_finishes_one_interrupted_after_its_publish(
    hot_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(hot_dir, 1)
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    quarantine(tier, bad, "found damaged")
    faults.arm("quarantine.restore_after_publish")
    with pytest.raises(FaultInjected):
        restore_quarantined(Store(hot_dir), bad.name)
    # Left published and recorded: `--delete` must not take its data, `--restore` finishes.
    assert tier.find_manifest(bad.name) == bad and list_quarantined(Store(hot_dir))
    assert main(["quarantine", "--hot", hot_dir, "--delete", bad.name, "--yes"]) == 1
    capsys.readouterr()
    assert main(["quarantine", "--hot", hot_dir, "--restore", bad.name]) == 0
    assert f"restored  {bad.name}  {bad.attempt}" in capsys.readouterr().out
    assert list_quarantined(Store(hot_dir)) == [] and tier.find_manifest(bad.name) == bad
    state, _ = load(hot_dir, name=bad.name)
    assert matches(state, 2)


def test_the_state_an_interrupted_restore_leaves_is_finished_by_restore(hot_dir: str) -> None:
    """Built by hand (publish done, record not yet deleted), so it needs no fault point."""
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    quarantine(tier, bad, "found damaged")
    tier.publish_manifest(bad)
    done = restore_quarantined(Store(hot_dir), bad.name)
    assert [q.attempt for q in done] == [bad.attempt]
    assert list_quarantined(Store(hot_dir)) == [] and tier.find_manifest(bad.name) == bad


def test_restore_refuses_data_that_is_no_longer_whole(hot_dir: str) -> None:
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    quarantine(tier, bad, "found damaged")
    file_path(hot_dir, bad).unlink()  # a prune that had decided on it before, a person
    with pytest.raises(IntegrityError, match="not whole"):
        restore_quarantined(Store(hot_dir), bad.name)
    assert tier.find_manifest(bad.name) is None  # never published naming a missing file
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [bad.attempt]
    delete_quarantined(Store(hot_dir), bad.name)
    assert list_quarantined(Store(hot_dir)) == []


# -- a resume's quarantine against a prune and a restore running beside it ----------------


def test_a_prune_that_decided_before_a_quarantine_leaves_the_quarantined_data(
    hot_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3):
        saved(hot_dir, step)
    tier = Tier("hot", hot_dir)
    oldest, middle = (tier.find_manifest(layout.default_name(step)) for step in (1, 2))
    assert oldest is not None and middle is not None
    point = faults.point

    def quarantined_after_the_listing(name: str) -> None:
        if name == "prune.after_listing":  # the prune has decided on steps 1 and 2
            assert quarantine(Tier("hot", hot_dir), oldest, "a resume found it damaged")
        point(name)

    monkeypatch.setattr(faults, "point", quarantined_after_the_listing)
    prune_tier(tier, keep_last(1))
    assert [c.step for c in list_checkpoints(hot_dir)] == [3]
    assert file_path(hot_dir, oldest).exists()  # only a person removes quarantined data
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [oldest.attempt]
    assert not file_path(hot_dir, middle).exists()  # the other one pruned as planned


def test_a_resume_quarantining_it_during_a_restore_keeps_it_recorded(
    hot_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    quarantine(tier, bad, "found damaged")
    point = faults.point

    def quarantined_again(name: str) -> None:
        if name == "quarantine.restore_after_publish":  # published, record not yet dropped
            assert quarantine(Tier("hot", hot_dir), bad, "found damaged again")
        point(name)

    monkeypatch.setattr(faults, "point", quarantined_again)
    restore_quarantined(Store(hot_dir), bad.name)
    assert Tier("hot", hot_dir).find_manifest(bad.name) is None  # the resume's word stands
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [bad.attempt]  # data named
    assert file_path(hot_dir, bad).exists()


def test_a_restore_finishing_during_a_quarantine_leaves_it_recorded(
    hot_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = saved(hot_dir, 2)
    tier = Tier("hot", hot_dir)
    quarantine(tier, bad, "found damaged")
    tier.publish_manifest(bad)  # a restore interrupted after its publish
    point = faults.point

    def restored_meanwhile(name: str) -> None:
        if name == "quarantine.after_record":  # a person's --restore drops the record here
            restore_quarantined(Store(hot_dir), bad.name)
        point(name)

    monkeypatch.setattr(faults, "point", restored_meanwhile)
    assert quarantine(Tier("hot", hot_dir), bad, "found damaged again")
    assert Tier("hot", hot_dir).find_manifest(bad.name) is None
    assert [q.attempt for q in list_quarantined(Store(hot_dir))] == [bad.attempt]  # data named
