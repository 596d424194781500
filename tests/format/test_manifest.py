from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest, _checksum

ATTEMPT = "20261129T081814Z-3fa2b1c4"


def make(**over) -> Manifest:
    fields = dict(
        name="step-0000000010",
        step=10,
        attempt=ATTEMPT,
        world_size=2,
        created=1795940907.25,
        files=(
            FileEntry(".metadata", 900, 0xDEADBEEF, 0),
            FileEntry("__0_0.distcp", 1 << 20, 12345, 0),
            FileEntry("__1_0.distcp", 1 << 20, 54321, 1),
        ),
        producer="tierstore test",
    )
    fields.update(over)
    return Manifest(**fields)


def reseal(body: dict) -> bytes:
    """Re-sign a tampered body, so only the targeted validation can catch it."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = _checksum(body)
    return json.dumps(body).encode()


def test_round_trip() -> None:
    m = make()
    assert Manifest.from_json(m.to_json()) == m
    assert m.total_size == 900 + (2 << 20)
    assert m.file("__1_0.distcp").rank == 1 and m.file("nope") is None
    assert [f.path for f in m.files_of_rank(0)] == [".metadata", "__0_0.distcp"]


@given(
    step=st.one_of(st.none(), st.integers(0, 1 << 40)),
    world=st.integers(1, 64),
    sizes=st.lists(st.integers(0, 1 << 45), min_size=1, max_size=20),
    created=st.floats(0, 4e9, allow_nan=False),
)
def test_round_trip_property(step, world, sizes, created) -> None:
    files = [FileEntry(".metadata", 10, 1, 0)] + [
        FileEntry(f"__{i % world}_{i}.distcp", size, (size * 2654435761) % (1 << 32), i % world)
        for i, size in enumerate(sizes)
    ]
    m = make(step=step, world_size=world, files=tuple(files), created=created)
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    "path",
    ["../escape", "/etc/passwd", "a/../../b", "./x", "a//b", "a\\b", "", "x\x00y", "..", "a/" * 10 + "b"],
)
def test_unsafe_paths_rejected(path: str) -> None:
    body = json.loads(make().to_json())
    body["files"][1]["path"] = path
    with pytest.raises(InvalidManifest, match="unsafe file path|invalid manifest"):
        Manifest.from_json(reseal(body), key="manifests/x.json", tier="hot /h")


def test_writer_refuses_to_serialize_unsafe_path() -> None:
    with pytest.raises(ConfigError):
        make(files=(FileEntry(".metadata", 1, 1, 0), FileEntry("../x", 1, 1, 0))).to_json()


def test_wrong_self_checksum_rejected() -> None:
    body = json.loads(make().to_json())
    body["files"][1]["size"] += 1  # tampered, not re-signed
    with pytest.raises(InvalidManifest, match="self-checksum") as info:
        Manifest.from_json(json.dumps(body).encode(), key="manifests/step.json", tier="hot /h")
    assert info.value.key == "manifests/step.json" and info.value.tier == "hot /h"
    assert "manifests/step.json" in str(info.value) and "hot /h" in str(info.value)


@pytest.mark.parametrize("cut", [1, 10, 100, -3])
def test_truncated_rejected(cut: int) -> None:
    data = make().to_json()
    with pytest.raises(InvalidManifest, match="not valid JSON|truncated"):
        Manifest.from_json(data[:cut])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.update(version=3), "newer tierstore"),
        (lambda b: b.update(format="other"), "format"),
        (lambda b: b.update(extra=1), "unexpected"),
        (lambda b: b.pop("world_size"), "missing"),
        (lambda b: b.update(world_size=True), "world_size"),
        (lambda b: b.update(step=-1), "step"),
        (lambda b: b.update(name="../x"), "invalid checkpoint name"),
        (lambda b: b.update(attempt="now"), "attempt"),
        (lambda b: b["files"][1].update(size=1 << 60), "absurd size"),
        (lambda b: b["files"][1].update(size=-5), "absurd size"),
        (lambda b: b["files"][1].update(crc32c=1 << 33), "crc32c"),
        (lambda b: b["files"][1].update(rank=7), "outside world size"),
        (lambda b: b["files"].append(dict(b["files"][1])), "listed twice"),
        (lambda b: b["files"].pop(0), "metadata file"),
        (lambda b: b.update(files=[]), "non-empty"),
        (lambda b: b["files"][1].update(symlink="/etc"), "exactly"),
        (lambda b: b.update(created="yesterday"), "created"),
    ],
)
def test_strict_validation(mutate, match) -> None:
    body = json.loads(make().to_json())
    mutate(body)
    with pytest.raises(InvalidManifest, match=match):
        Manifest.from_json(reseal(body))


def test_not_an_object_and_not_utf8() -> None:
    with pytest.raises(InvalidManifest):
        Manifest.from_json(b"[1, 2]")
    with pytest.raises(InvalidManifest):
        Manifest.from_json(b"\xff\xfe")


def test_oversized_manifest_rejected_before_parsing() -> None:
    with pytest.raises(InvalidManifest, match="larger than"):
        Manifest.from_json(b" " * ((64 << 20) + 1))


def test_manifest_stored_under_another_name_rejected() -> None:
    with pytest.raises(InvalidManifest, match="stored as"):
        Manifest.from_json(make().to_json(), expect_name="step-0000000011")


def test_layout_names() -> None:
    assert layout.default_name(1200) == "step-0000001200"
    assert layout.manifest_key("step-0000001200") == "manifests/step-0000001200.json"
    assert layout.parse_manifest_key("manifests/step-0000001200.json") == "step-0000001200"
    assert layout.parse_manifest_key("manifests/.step.json.tmp-abc") is None
    assert layout.parse_manifest_key("checkpoints/x.json") is None
    a = layout.new_attempt()
    assert layout.check_attempt(a) == a and a != layout.new_attempt()
    assert layout.file_key("n", a, "__0_0.distcp") == f"checkpoints/n/{a}/__0_0.distcp"
    assert layout.upload_mark_key("n", a, 3) == f"uploads/n/{a}/rank-3.json"
    for bad in ["", "../x", "a/b", ".hidden", "x" * 129, "a b", "x.tmp"]:
        with pytest.raises(ConfigError):
            layout.check_name(bad)
