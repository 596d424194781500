"""A manifest is an honest value: a frozen root, read-only fields, and a part index that is
a cache, read through the tier that read the root."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest, ManifestRoot, PartRef
from tierstore.tiers.tier import Tier

ATTEMPT = "20261129T081814Z-3fa2b1c4"


def two_level(world: int = 6, part_ranks: int = 2) -> Manifest:
    files = [FileEntry(".metadata", 100, 1, 0)]
    files += [FileEntry(f"__{r}_0.distcp", 1000 + r, 7 + r, r) for r in range(world)]
    return Manifest("step-0000000004", 4, ATTEMPT, world, 1795940907.25, files, part_ranks=part_ranks)


def test_the_root_is_frozen_and_the_manifest_read_only() -> None:
    manifest = two_level()
    assert isinstance(manifest.root, ManifestRoot)
    with pytest.raises(dataclasses.FrozenInstanceError):
        manifest.root.step = 5  # type: ignore[misc]
    for field in ("step", "name", "root", "attempt"):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(manifest, field, None)
    assert manifest.step == 4 and manifest.root.num_files == 7


def test_equal_manifests_have_equal_roots_whatever_parts_were_read() -> None:
    built = two_level()
    url = f"memory://manifest-root-eq-{uuid.uuid4().hex}"
    Tier("hot", url).publish_manifest(built)
    read = Tier("hot", url).find_manifest(built.name)  # a fresh tier: read and parsed
    assert read is not None and read is not built
    assert read == built and hash(read) == hash(built)
    read.files_of_rank(3)  # reads one part: the value does not change
    assert read == built and read.root == built.root
    assert read.files == built.files
    other = Manifest(built.name, 4, ATTEMPT, 6, 1795940907.25, [*built.files[:-1]], part_ranks=2)
    assert other != built


def test_parts_are_read_through_the_tier_only_when_an_entry_of_theirs_is_asked_for() -> None:
    built = two_level(world=8, part_ranks=2)
    reads: list[PartRef] = []

    def loader(name: str, attempt: str, ref: PartRef) -> tuple[str, bytes]:
        reads.append(ref)
        return f"{name}/{attempt}/{ref.path}", built.part_json(ref)

    read = Manifest.from_json(built.to_json(), loader=loader)
    assert reads == [] and read.num_files == 9 and read.total_size == built.total_size
    assert read.file(".metadata") == built.file(".metadata") and reads == []
    assert [f.rank for f in read.files_of_rank(5)] == [5]
    assert [ref.index for ref in reads] == [2]
    read.files_of_rank(4)  # the same part: kept, not read again
    assert len(reads) == 1
    assert read.files == built.files and len(reads) == len(built.parts)


def test_a_root_read_without_a_tier_says_so_when_a_part_is_needed() -> None:
    read = Manifest.from_json(two_level().to_json())
    with pytest.raises(ConfigError, match="without a tier"):
        read.files_of_rank(1)


def test_a_flat_manifest_is_its_root() -> None:
    flat = Manifest(
        "step-0000000001",
        1,
        ATTEMPT,
        1,
        1.0,
        [FileEntry(".metadata", 3, 1, 0), FileEntry("__0_0.distcp", 5, 2, 0)],
    )
    assert flat.root.files == flat.files and flat.parts == () and flat.root.metadata is None
    assert Manifest.from_json(flat.to_json()) == flat
    assert flat.metadata_file == layout.METADATA_FILE


def test_a_manifest_pickles_with_the_parts_it_has_read() -> None:
    import pickle

    built = two_level()
    copy = pickle.loads(pickle.dumps(built))
    assert copy == built and copy.files == built.files
    with pytest.raises(AttributeError, match="read-only"):
        copy.step = 1  # type: ignore[misc]
