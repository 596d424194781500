"""The two-level manifest: a root at the manifest key, parts of a rank range each.

Proves: small checkpoints keep the flat version 1 bytes; a root and its parts round-trip and
are strictly validated; a save of 6 ranks in parts of 2 loads, migrates and lists; listing and
finding read roots only, a rank's entries read one part, and repeated listings re-read
nothing unchanged while a re-committed name is never served stale; a tampered, swapped or
missing part is an ``InvalidManifest`` naming part key, checkpoint and tier, and that
checkpoint is not loaded; a save whose manifest would break a limit fails before any byte.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import unwrap
from simulated_ranks import holds_saved, load_state, save_ranks

from tierstore import TieredReader, WriterOptions, list_checkpoints
from tierstore.errors import ConfigError, IntegrityError, InvalidManifest
from tierstore.format import layout
from tierstore.format import manifest_format as fmt
from tierstore.format.manifest import FileEntry, Manifest, PartRef, _checksum
from tierstore.migration.migrator import MigrationOptions
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import Backend, ObjectInfo
from tierstore.tiers.tier import Store, Tier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ATTEMPT = "20261129T081814Z-3fa2b1c4"
FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=10,
    retry=RetryPolicy(attempts=3, initial=0.001, maximum=0.01),
)
GOLDEN = Path(__file__).parents[1] / "data" / "store-0.2"


def make(
    world: int = 6, part_ranks: int = 2, name: str = "step-0000000010", attempt: str = ATTEMPT
) -> Manifest:
    files = [FileEntry(".metadata", 900, 0xDEADBEEF, 0)] + [
        FileEntry(f"__{rank}_{i}.distcp", 1000 * rank + i, rank * 7 + i, rank)
        for rank in range(world)
        for i in range(2)
    ]
    return Manifest(
        name=name,
        step=10,
        attempt=attempt,
        world_size=world,
        created=1795940907.25,
        files=tuple(files),
        producer="tierstore test",
        encoding="raw",
        part_ranks=part_ranks,
    )


class PartStore:
    """The parts of ``manifest``, served to a root's loader, counting what is read."""

    def __init__(self, manifest: Manifest) -> None:
        self.data = {ref.path: manifest.part_json(ref) for ref in manifest.parts}
        self.reads: list[str] = []

    def __call__(self, name: str, attempt: str, ref: PartRef) -> tuple[str, bytes]:
        self.reads.append(ref.path)
        return f"{name}/{attempt}/{ref.path}", self.data[ref.path]


def reseal(body: dict[str, Any]) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    return json.dumps({**body, "checksum": _checksum(body)}).encode()


# -- the forms -------------------------------------------------------------------------


def test_a_checkpoint_of_few_ranks_keeps_the_flat_form_byte_for_byte() -> None:
    for path in (GOLDEN / "manifests").glob("*.json"):
        stored = path.read_bytes()
        parsed = Manifest.from_json(stored)
        assert parsed.version == 1 and parsed.parts == ()
        assert parsed.to_json() == stored  # what 0.2 wrote, this version writes
    flat = make(world=6, part_ranks=6)
    assert flat.version == 1 and json.loads(flat.to_json())["version"] == 1
    assert "parts" not in json.loads(flat.to_json())


def test_root_and_parts_round_trip_and_a_rank_reads_only_its_part() -> None:
    built = make()
    assert built.version == 2 and [(p.first_rank, p.last_rank) for p in built.parts] == [
        (0, 1),
        (2, 3),
        (4, 5),
    ]
    parts = PartStore(built)
    root = Manifest.from_json(built.to_json(), loader=parts)
    assert root == built and root.total_size == built.total_size and root.num_files == 13
    assert root.file(".metadata") == FileEntry(".metadata", 900, 0xDEADBEEF, 0)
    assert parts.reads == []  # the header, totals and .metadata come from the root
    assert [f.path for f in root.files_of_rank(3)] == ["__3_0.distcp", "__3_1.distcp"]
    assert parts.reads == [layout.manifest_part_path(1)]
    assert root.file("__2_1.distcp") == FileEntry("__2_1.distcp", 2001, 15, 2)  # same part: no read
    assert [f.path for f in root.files_of_rank(0)] == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert len(parts.reads) == 2
    assert root.files == built.files and root.ranks() == list(range(6))
    assert sorted(parts.reads) == [p.path for p in built.parts]  # each part read once


def test_each_part_names_its_checkpoint_attempt_and_rank_range() -> None:
    built = make()
    body = json.loads(built.part_json(built.parts[2]))
    assert (body["format"], body["name"], body["attempt"], body["index"]) == (
        fmt.PART_FORMAT,
        built.name,
        ATTEMPT,
        2,
    )
    assert (body["first_rank"], body["last_rank"]) == (4, 5)
    root = json.loads(built.to_json())
    assert root["parts"][2]["sha256"] == fmt.digest(built.part_json(built.parts[2]))
    assert root["metadata"]["path"] == ".metadata" and root["file_count"] == 13


def _ref(i: int) -> dict[str, Any]:
    return {
        "path": layout.manifest_part_path(i),
        "first_rank": 2 * i,
        "last_rank": 2 * i + 1,
        "files": 4,
        "size": 300,
        "sha256": "sha256:" + "0" * 64,
    }


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b["parts"][1].update(first_rank=1), "overlap"),
        (lambda b: b["parts"].reverse(), "is not"),  # paths follow the index
        (lambda b: b["parts"][2].update(last_rank=6), "outside world size"),
        (lambda b: b["parts"][0].update(path="__0_0.distcp"), "path"),
        (lambda b: b["parts"][0].update(path="../../manifests/x.json"), "path"),
        (lambda b: b["parts"][0].update(sha256="md5:00"), "sha256"),
        (lambda b: b["parts"][0].update(size=1 << 40), "bad size"),
        (lambda b: b.update(parts=[]), "parts is not"),
        (lambda b: b.update(parts=[_ref(i) for i in range(fmt.MAX_PARTS + 1)]), "parts is not"),
        (lambda b: b.update(file_count=12), "file_count"),
        (lambda b: b["metadata"].update(rank=6), "outside world size"),
        (lambda b: b["metadata"].update(path="/etc/passwd"), "unsafe"),
        (lambda b: b.update(extra=1), "unexpected"),
        (lambda b: b.pop("total_size"), "missing"),
    ],
)
def test_a_forged_root_is_refused(mutate: Any, match: str) -> None:
    body = json.loads(make().to_json())
    mutate(body)
    with pytest.raises(InvalidManifest, match=match) as info:
        Manifest.from_json(reseal(body), key="manifests/step-0000000010.json", tier="hot /h")
    assert info.value.key == "manifests/step-0000000010.json" and info.value.tier == "hot /h"


def _reroot(built: Manifest, index: int, data: bytes) -> bytes:
    """``built``'s root, re-signed to vouch for ``data`` as part ``index`` (a forger's root)."""
    body = json.loads(built.to_json())
    body["parts"][index].update(size=len(data), sha256=fmt.digest(data))
    return reseal(body)


def _forged_part(built: Manifest, which: int, /, **changes: Any) -> bytes:
    body = json.loads(built.part_json(built.parts[which]))
    body.update(changes)
    return fmt.encode_part(body)


def _renamed_entry(built: Manifest, path: str) -> bytes:
    body = json.loads(built.part_json(built.parts[1]))
    body["files"][0]["path"] = path
    return fmt.encode_part(body)


@pytest.mark.parametrize(
    "forge, match",
    [
        (lambda b: _forged_part(b, 1, name="step-0000000011"), "names checkpoint"),
        (lambda b: _forged_part(b, 1, attempt="20261129T081814Z-00000000"), "names checkpoint"),
        (lambda b: _forged_part(b, 1, index=2), "part 2"),
        (lambda b: _forged_part(b, 1, first_rank=0), "rank range"),
        (
            lambda b: _forged_part(b, 1, files=[{"path": "__0_9.distcp", "size": 1, "crc32c": 1, "rank": 0}]),
            "outside the part's ranks",
        ),
        (lambda b: _renamed_entry(b, ".metadata"), "metadata file"),
        (lambda b: _forged_part(b, 1, extra=1), "unexpected"),
        (lambda b: b"[" * 100_000, "not valid JSON"),
    ],
)
def test_a_forged_part_is_refused_even_under_a_resealed_root(forge: Any, match: str) -> None:
    built = make()
    data = forge(built)
    parts = PartStore(built)
    parts.data[built.parts[1].path] = data
    root = Manifest.from_json(_reroot(built, 1, data), tier="hot /h", loader=parts)
    with pytest.raises(InvalidManifest, match=match) as info:
        root.files_of_rank(2)
    assert info.value.key == f"{built.name}/{ATTEMPT}/{built.parts[1].path}"
    assert info.value.checkpoint == built.name and info.value.tier == "hot /h"


def test_a_path_listed_in_two_parts_is_refused_when_the_parts_meet() -> None:
    built = make()
    data = _renamed_entry(built, "__0_0.distcp")  # rank 2's entry under rank 0's file name
    parts = PartStore(built)
    parts.data[built.parts[1].path] = data
    root = Manifest.from_json(_reroot(built, 1, data), loader=parts)
    with pytest.raises(InvalidManifest, match="two parts"):
        root.files  # noqa: B018


def test_a_part_is_checked_against_the_roots_digest() -> None:
    built = make()
    parts = PartStore(built)
    good = parts.data[built.parts[0].path]
    parts.data[built.parts[0].path] = good[:40] + bytes([good[40] ^ 1]) + good[41:]
    root = Manifest.from_json(built.to_json(), loader=parts)
    with pytest.raises(InvalidManifest, match="sha256 differs"):
        root.files_of_rank(1)
    assert root.files_of_rank(4)  # the other parts stay readable


# -- limits, before any byte -----------------------------------------------------------


def test_check_plan_bounds_every_form() -> None:
    assert fmt.check_plan("n", [1] * 8, part_ranks=8, path_len=20) == 0
    assert fmt.check_plan("n", [1] * 9, part_ranks=8, path_len=20) == 2
    assert fmt.check_plan("n", [1] * 16 + [0] * 8 + [1], part_ranks=8, path_len=20) == 3
    with pytest.raises(ConfigError, match="MAX_FILES") as info:
        fmt.check_plan("big", [fmt.MAX_FILES], part_ranks=8, path_len=20)
    assert info.value.checkpoint == "big"
    with pytest.raises(ConfigError, match="MAX_MANIFEST_BYTES"):
        fmt.check_plan("big", [fmt.MAX_FILES // 4] * 2, part_ranks=8, path_len=255)
    with pytest.raises(ConfigError, match="MAX_PART_BYTES"):
        fmt.check_plan("big", [fmt.MAX_FILES // 16] * 9, part_ranks=8, path_len=255)
    with pytest.raises(ConfigError, match="MAX_PARTS"):
        fmt.check_plan("big", [1] * (fmt.MAX_PARTS + 1), part_ranks=1, path_len=20)


def _data_files(hot: Path) -> list[Path]:
    return [p for p in hot.rglob("*") if p.is_file() and layout.DATA_DIR in p.parts]


@pytest.mark.parametrize(
    "limit, value, options",
    [
        ("MAX_MANIFEST_BYTES", 1500, {}),  # flat: 4 ranks
        ("MAX_PARTS", 1, {"options": WriterOptions(manifest_part_ranks=2)}),
        ("MAX_PART_BYTES", 300, {"options": WriterOptions(manifest_part_ranks=2)}),
    ],
)
def test_a_save_over_a_manifest_limit_fails_before_writing_any_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, value: int, options: dict[str, Any]
) -> None:
    monkeypatch.setattr(fmt, limit, value)
    with pytest.raises(ConfigError, match=limit) as info:
        save_ranks(4, str(tmp_path / "hot"), **options)
    assert info.value.checkpoint == layout.default_name(1)
    assert _data_files(tmp_path / "hot") == []
    assert list_checkpoints(str(tmp_path / "hot")) == []


def test_part_ranks_come_from_the_argument_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_MANIFEST_PART_RANKS", "3")
    manifest, _ = save_ranks(6, str(tmp_path / "a"))
    assert [(p.first_rank, p.last_rank) for p in manifest.parts] == [(0, 2), (3, 5)]
    manifest, _ = save_ranks(6, str(tmp_path / "b"), options=WriterOptions(manifest_part_ranks=6))
    assert manifest.version == 1
    monkeypatch.setenv("TIERSTORE_MANIFEST_PART_RANKS", "lots")
    with pytest.raises(ConfigError, match="TIERSTORE_MANIFEST_PART_RANKS"):
        save_ranks(2, str(tmp_path / "c"))


# -- in a store --------------------------------------------------------------------------


class Counting:
    """Forwards every call to a real backend, recording each object read and each listing."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.reads: list[str] = []
        self.lists: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_bytes(self, key: str, **kwargs: Any) -> bytes:
        self.reads.append(key)
        return self.inner.read_bytes(key, **kwargs)

    def open_read(self, key: str) -> Any:
        self.reads.append(key)
        return self.inner.open_read(key)

    def open_range(self, key: str, offset: int, length: int) -> Any:
        self.reads.append(key)
        return self.inner.open_range(key, offset, length)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.lists.append(prefix)
        return self.inner.list(prefix)


def counted(tier: Tier) -> Counting:
    spy = Counting(tier.backend)
    tier._backend = spy  # type: ignore[assignment]
    return spy


@pytest.fixture(params=["local", "s3"])
def cold_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A hot directory and a cold tier: another directory, or a bucket of the S3 emulator."""
    if request.param == "local":
        return Store(str(tmp_path / "hot"), str(tmp_path / "cold"))
    pytest.importorskip("tierstore_s3")
    options = {
        "endpoint_url": request.getfixturevalue("s3_endpoint"),
        "key": "testing",
        "secret": "testing",
        "region": "us-west-2",
    }
    return Store(
        str(tmp_path / "hot"), f"s3://{request.getfixturevalue('s3_bucket')}/run", cold_options=options
    )


def test_a_save_of_six_ranks_in_parts_loads_migrates_and_lists(cold_store: Store) -> None:
    manifest, writers = save_ranks(
        6, cold_store, options=WriterOptions(manifest_part_ranks=2), migration=FAST
    )
    assert writers[0].migrator is not None and writers[0].migrator.wait(30)
    assert manifest.version == 2 and len(manifest.parts) == 3
    for tier in cold_store.tiers:
        assert tier.backend.read_bytes(layout.manifest_key(manifest.name)) == manifest.to_json()
        for ref in manifest.parts:
            key = tier.file_key(manifest.name, manifest.attempt, ref.path)
            assert tier.backend.read_bytes(key) == manifest.part_json(ref)
    [info] = list_checkpoints(cold_store)
    assert (info.tiers, info.num_files, info.size, info.world_size) == (
        ("hot", "cold"),
        7,
        manifest.total_size,
        6,
    )
    for tiers in (Store.of_tiers(cold_store.hot, None), Store.of_tiers(None, cold_store.cold)):
        state = load_state(6)
        dcp.load(state, storage_reader=TieredReader(tiers, step=1))
        assert holds_saved(state, 6)


def test_listing_and_finding_read_roots_only_and_a_rank_reads_one_part(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    for step in (1, 2):
        save_ranks(6, hot, step=step, options=WriterOptions(manifest_part_ranks=2))
    tier = Tier("hot", hot)
    spy = counted(tier)
    found = tier.manifests()
    assert sorted(spy.reads) == [layout.manifest_key(layout.default_name(s)) for s in (1, 2)]
    assert [m.num_files for m in found] == [7, 7]
    spy.reads.clear()
    manifest = tier.find_manifest(layout.default_name(2))
    assert manifest is not None and spy.reads == [layout.manifest_key(manifest.name)]
    spy.reads.clear()
    assert [f.rank for f in manifest.files_of_rank(3)] == [3]
    assert spy.reads == [tier.file_key(manifest.name, manifest.attempt, manifest.parts[1].path)]
    manifest.files_of_rank(2)
    assert len(spy.reads) == 1  # same part, kept


def test_repeated_listings_reread_nothing_and_a_recommitted_name_is_never_stale(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    first, _ = save_ranks(6, hot, options=WriterOptions(manifest_part_ranks=2))
    tier = Tier("hot", hot)
    spy = counted(tier)
    [listed] = tier.manifests()
    listed.files_of_rank(5)
    spy.reads.clear()
    [again] = tier.manifests()
    assert spy.reads == [] and again.files_of_rank(5) and spy.reads == []  # root and part kept
    # The name is deleted and committed again by a new attempt of other content.
    (Path(hot) / layout.manifest_key(first.name)).unlink()
    shutil.rmtree(Path(hot) / layout.checkpoint_prefix(first.name))
    second, _ = save_ranks(4, hot, options=WriterOptions(manifest_part_ranks=2))
    assert second.attempt != first.attempt
    [fresh] = tier.manifests()
    assert fresh.attempt == second.attempt and fresh.world_size == 4 and fresh == second
    assert fresh.files_of_rank(5) == ()
    found = tier.find_manifest(first.name)
    assert found is not None and found.attempt == second.attempt


def _damage(hot: Path, manifest: Manifest, how: str, other: Manifest) -> Path:
    part = hot / layout.file_key(manifest.name, manifest.attempt, manifest.parts[1].path)
    if how == "flipped":
        data = bytearray(part.read_bytes())
        data[30] ^= 1
        part.write_bytes(bytes(data))
    elif how == "swapped":  # the same part of another checkpoint: valid JSON, wrong names
        shutil.copyfile(hot / layout.file_key(other.name, other.attempt, other.parts[1].path), part)
    else:
        part.unlink()
    return part


@pytest.mark.parametrize("how", ["flipped", "swapped", "missing"])
def test_a_damaged_part_is_named_and_its_checkpoint_is_not_loaded(tmp_path: Path, how: str) -> None:
    hot = tmp_path / "hot"
    older, _ = save_ranks(6, str(hot), step=1, options=WriterOptions(manifest_part_ranks=2))
    newer, _ = save_ranks(6, str(hot), step=2, options=WriterOptions(manifest_part_ranks=2))
    part = _damage(hot, newer, how, older)
    tier = Tier("hot", str(hot))
    manifest = tier.find_manifest(newer.name)
    assert manifest is not None and manifest.files_of_rank(0)  # the root and other parts are fine
    with pytest.raises(InvalidManifest) as info:
        manifest.files_of_rank(3)
    key = str(part.relative_to(hot))
    assert (info.value.key, info.value.checkpoint, info.value.tier) == (key, newer.name, tier.label)
    assert key in str(info.value) and newer.name in str(info.value)
    state = load_state(6, step=2)
    with pytest.raises(BaseException) as failure:
        dcp.load(state, storage_reader=TieredReader(str(hot), step=2))
    error = unwrap(failure.value)
    assert isinstance(error, IntegrityError) and newer.name in str(error)
    assert not holds_saved(state, 6, step=2)


def test_picking_the_latest_checks_its_files_by_one_listing_without_reading_a_part(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    save_ranks(6, hot, step=1, options=WriterOptions(manifest_part_ranks=2))
    newest, _ = save_ranks(6, hot, step=2, options=WriterOptions(manifest_part_ranks=2))
    tier = Tier("hot", hot)
    spy = counted(tier)
    parts = {tier.file_key(newest.name, newest.attempt, ref.path) for ref in newest.parts}
    reader = TieredReader(Store.of_tiers(tier, None))
    reader.read_metadata()
    reader.release()
    assert reader.manifest is not None and reader.manifest.name == newest.name
    assert not parts & set(spy.reads), "the coordinator read a part to check the data files"
    # One data file gone: the totals no longer add up, the file-by-file check names it, and
    # the older checkpoint is picked instead.
    victim = newest.files_of_rank(4)[0]
    (Path(hot) / tier.file_key(newest.name, newest.attempt, victim.path)).unlink()
    reader = TieredReader(Store.of_tiers(Tier("hot", hot), None))
    reader.read_metadata()
    reader.release()
    assert reader.manifest is not None and reader.manifest.step == 1
