"""What a node keeps for other nodes (issue 37): the protection record, the sink that keeps
a received file only when it is the manifest's bytes, and ``drop_copies`` removing one
attempt's copies and nothing else. Real local tiers in ``tmp_path``."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from helpers import saved

from tierstore.errors import NoSpaceLeft, ObjectNotFound, StorageError
from tierstore.format import layout
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.redundancy import Parity, Replicas, Topology
from tierstore.redundancy.records import (
    FileSink,
    FileSource,
    Record,
    drop_copies,
    peer_tier,
    read_record,
    record_key,
    write_record,
)
from tierstore.storage.checksum import crc32c_update
from tierstore.storage.local_writer import LocalWriter
from tierstore.tiers.tier import Tier

NAME = layout.default_name(3)
ATTEMPT = layout.new_attempt()


def replicas_record(name: str = NAME, attempt: str = ATTEMPT) -> Record:
    return Record(name, attempt, Replicas(3), Topology(8, 2), {0: [0, 1, 2], 1: [0, 1, 2], 6: [3, 0]}, {})


def parity_record(name: str = NAME, attempt: str = ATTEMPT) -> Record:
    parity = {"parity/l0-s1.bin@1": (4096, 0xDEADBEEF), "parity/l1-s0.bin@0": (0, 0)}
    return Record(name, attempt, Parity(2, 1), Topology(6, 2), {0: [0], 2: [1]}, parity)


# -- the record ----------------------------------------------------------------------------


@pytest.mark.parametrize("record", [replicas_record(), parity_record()], ids=["replicas", "parity"])
def test_a_record_round_trips_through_json(record: Record) -> None:
    back = Record.from_json(record.to_json(), name=NAME, attempt=ATTEMPT)
    assert back == record
    assert back.to_json() == record.to_json()  # sorted keys: every node writes the same bytes
    assert type(back.scheme) is type(record.scheme)


def test_a_records_copies_are_its_least_protected_ranks() -> None:
    assert replicas_record().copies == 2  # rank 6 has two holders, the others three
    assert parity_record().copies == 2  # m + 1
    assert Record(NAME, ATTEMPT, Parity(2, 1), Topology(6, 2), {}, {}).copies == 1  # nobody verified
    assert Record(NAME, ATTEMPT, Replicas(2), Topology(4, 2), {}, {}).copies == 1


def test_from_json_refuses_another_name_or_attempt() -> None:
    data = replicas_record().to_json()
    with pytest.raises(ValueError, match="the record names"):
        Record.from_json(data, name=layout.default_name(4), attempt=ATTEMPT)
    with pytest.raises(ValueError, match="the record names"):
        Record.from_json(data, name=NAME, attempt=layout.new_attempt(1.0))


@pytest.mark.parametrize("body", [b'{"format": 2}', b"[1]", b'{"name": "x"}', b'"format"'])
def test_from_json_refuses_an_unknown_format(body: bytes) -> None:
    with pytest.raises(ValueError, match="not a protection record of format 1"):
        Record.from_json(body, name=NAME, attempt=ATTEMPT)


class _Named:
    """What read_record asks of a manifest: its name and attempt."""

    def __init__(self, name: str, attempt: str) -> None:
        self.name, self.attempt = name, attempt


def test_read_record_reads_what_write_record_wrote(tmp_path: Path) -> None:
    peers = peer_tier(Tier("hot", str(tmp_path / "hot")))
    write_record(peers, parity_record())
    assert (tmp_path / "hot" / layout.REPLICA_DIR / record_key(NAME, ATTEMPT)).is_file()
    assert read_record(peers, _Named(NAME, ATTEMPT)) == parity_record()  # type: ignore[arg-type]
    assert read_record(peers, _Named(NAME, layout.new_attempt(1.0))) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # torn
        lambda data: b"\x00" * len(data),  # zeroed
        lambda data: data.replace(b'"replicas"', b'"mirrors"'),  # an unknown scheme
        lambda data: data.replace(b'"copies": 3', b'"copies": 1'),  # a scheme that cannot be
        lambda data: replicas_record(name=layout.default_name(9)).to_json(),  # another checkpoint's
    ],
    ids=["torn", "zeroed", "unknown-scheme", "invalid-scheme", "other-name"],
)
def test_read_record_returns_none_and_logs_for_a_damaged_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    peers = peer_tier(Tier("hot", str(tmp_path / "hot")))
    write_record(peers, replicas_record())
    path = tmp_path / "hot" / layout.REPLICA_DIR / record_key(NAME, ATTEMPT)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="tierstore.redundancy.records"):
        assert read_record(peers, _Named(NAME, ATTEMPT)) is None  # type: ignore[arg-type]
    [warning] = [r for r in caplog.records if r.name == "tierstore.redundancy.records"]
    assert "ignoring the protection record" in warning.getMessage() and NAME in warning.getMessage()


def test_read_record_of_an_absent_record_is_none_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    peers = peer_tier(Tier("hot", str(tmp_path / "hot")))
    with caplog.at_level(logging.WARNING):
        assert read_record(peers, _Named(NAME, ATTEMPT)) is None  # type: ignore[arg-type]
    assert not caplog.records


# -- the sink: a received file is kept only if it is the manifest's -------------------------

DATA = os.urandom(5000) + b"tail"  # odd length
KEY = f"checkpoints/{NAME}/{ATTEMPT}/__1_0.distcp"


def entry_of(data: bytes) -> FileEntry:
    return FileEntry("__1_0.distcp", len(data), crc32c_update(0, data), 1)


def receive(tier: Tier, expect: FileEntry | tuple[int, int], data: bytes, chunk: int = 777) -> FileSink:
    sink = FileSink(tier, KEY, expect)
    for at in range(0, len(data), chunk):
        sink.write(memoryview(data[at : at + chunk]))
    sink.close()
    return sink


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def peers(tmp_path: Path) -> Tier:
    return peer_tier(Tier("hot", str(tmp_path / "hot")))


def test_a_sink_keeps_the_right_bytes(peers: Tier) -> None:
    sink = receive(peers, entry_of(DATA), DATA)
    assert sink.ok and sink.error is None
    assert Path(peers.url, KEY).read_bytes() == DATA
    assert files_under(Path(peers.url)) == [Path(peers.url, KEY)]  # no temporary left beside it
    # The (size, crc) form of what to expect: a parity block's.
    again = FileSink(peers, KEY + ".2", (len(DATA), crc32c_update(0, DATA)))
    again.write(memoryview(DATA))
    again.close()
    assert again.ok and Path(peers.url, KEY + ".2").read_bytes() == DATA


def test_a_sink_keeps_an_empty_file(peers: Tier) -> None:
    # No write at all (a rank's empty file): close() alone opens, checks and keeps it.
    sink = receive(peers, entry_of(b""), b"")
    assert sink.ok and Path(peers.url, KEY).read_bytes() == b""


def _flipped(data: bytes) -> bytes:
    out = bytearray(data)
    out[1234] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize(
    ("arrived", "what"),
    [
        (_flipped(DATA), "flipped"),
        (DATA[:-1], "short"),
        (DATA + b"\x00", "long"),
        (b"", "nothing"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_sink_drops_bytes_that_are_not_the_manifests(peers: Tier, arrived: bytes, what: str) -> None:
    entry = entry_of(DATA)
    sink = receive(peers, entry, arrived)
    assert not sink.ok, what
    with pytest.raises(ObjectNotFound):
        peers.backend.stat(KEY)
    assert files_under(Path(peers.url)) == []  # nothing at the key, no temporary either
    assert sink.error is not None
    got = crc32c_update(0, arrived)
    assert f"arrived as {len(arrived)} bytes of CRC32C {got:08x}" in sink.error
    assert f"the manifest says {entry.size} bytes of {entry.crc32c:08x}" in sink.error


def test_a_sink_whose_write_fails_midway_takes_the_rest_and_ends_not_ok(
    peers: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk while a copy arrives: the transfer must stay in step (every byte still
    # taken, no exception to the wire) and the partial file must never be kept.
    real = LocalWriter._write
    calls = []

    def failing(self: LocalWriter, view: memoryview) -> None:
        calls.append(len(view))
        if len(calls) == 3:
            raise NoSpaceLeft("no space left on device (injected)")
        real(self, view)

    monkeypatch.setattr(LocalWriter, "_write", failing)
    sink = receive(peers, entry_of(DATA), DATA, chunk=500)
    assert len(calls) == 3  # the writer is not written to after it failed
    assert not sink.ok and sink.error is not None and "no space left" in sink.error
    assert files_under(Path(peers.url)) == []


def test_a_sink_that_cannot_open_takes_the_bytes_and_ends_not_ok(
    peers: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(key: str, **kwargs: object) -> None:
        raise StorageError(f"read-only file system: {key}")

    monkeypatch.setattr(peers.backend, "open_write", refuse)
    sink = receive(peers, entry_of(DATA), DATA)
    assert not sink.ok and "read-only file system" in (sink.error or "")
    assert files_under(Path(peers.url)) == []


def test_a_file_source_reads_a_file_in_pieces(peers: Tier) -> None:
    assert receive(peers, entry_of(DATA), DATA).ok
    source = FileSource(peers, KEY)
    pieces = [source.read(999) for _ in range(6)]
    assert source.read(10) == b""  # past the end: nothing, no error
    source.close()
    assert b"".join(pieces) == DATA and [len(p) for p in pieces[:5]] == [999] * 5


# -- drop_copies ---------------------------------------------------------------------------


def hold_copies(peers: Tier, hot: str, manifest: Manifest, *, publish: bool = True) -> list[Path]:
    """Make ``peers`` hold ``manifest``'s files (from ``hot``), its record and (``publish``)
    its manifest, as a protection round leaves them. The copies' paths."""
    paths = []
    for entry in manifest.files:
        target = Path(peers.url, peers.file_key(manifest.name, manifest.attempt, entry.path))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(hot, layout.file_key(manifest.name, manifest.attempt, entry.path)), target)
        paths.append(target)
    write_record(peers, replicas_record(manifest.name, manifest.attempt))
    if publish:
        peers.publish_manifest(manifest)
    return paths


def test_drop_copies_unpublishes_then_deletes_that_attempts_files_and_record(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    manifest = saved(hot, 3)
    peers = peer_tier(Tier("hot", hot))
    copies = hold_copies(peers, hot, manifest)
    record = Path(peers.url, record_key(manifest.name, manifest.attempt))
    assert record.is_file() and peers.find_manifest(manifest.name) is not None

    freed = drop_copies(peers, manifest)
    assert freed == sum(e.size for e in manifest.files)  # the copies' bytes
    assert peers.find_manifest(manifest.name) is None
    assert not any(p.exists() for p in copies) and not record.exists()
    assert not any(p.is_file() for p in Path(peers.url).rglob("*"))
    # The node's own checkpoint is not the copies': untouched.
    assert Tier("hot", hot).find_manifest(manifest.name) is not None
    assert all(
        Path(hot, layout.file_key(manifest.name, manifest.attempt, e.path)).is_file() for e in manifest.files
    )
    assert drop_copies(peers, manifest) == 0  # again: nothing left, no error


def test_drop_copies_of_an_unpublished_protection_still_deletes_its_files(tmp_path: Path) -> None:
    # A round that died before publishing leaves copies and a record but no manifest.
    hot = str(tmp_path / "hot")
    manifest = saved(hot, 3)
    peers = peer_tier(Tier("hot", hot))
    copies = hold_copies(peers, hot, manifest, publish=False)
    assert drop_copies(peers, manifest) == sum(e.size for e in manifest.files)
    assert not any(p.exists() for p in copies)
    assert not Path(peers.url, record_key(manifest.name, manifest.attempt)).exists()


def test_drop_copies_leaves_another_attempt_published_since(tmp_path: Path) -> None:
    # The name was committed again (a new attempt) and protected since the decision to drop
    # the old one was made: that decision must not delete the new protection, nor anything.
    old_hot, new_hot = str(tmp_path / "old"), str(tmp_path / "new")
    old, new = saved(old_hot, 3), saved(new_hot, 3)
    assert old.name == new.name and old.attempt != new.attempt
    peers = peer_tier(Tier("hot", str(tmp_path / "node")))
    old_copies = hold_copies(peers, old_hot, old, publish=False)
    new_copies = hold_copies(peers, new_hot, new)
    before = files_under(Path(peers.url))

    assert drop_copies(peers, old) == 0
    assert files_under(Path(peers.url)) == before  # nothing deleted
    here = peers.find_manifest(new.name)
    assert here is not None and here.attempt == new.attempt
    assert all(p.exists() for p in old_copies + new_copies)

    # Dropping the new attempt itself does remove it, and leaves the old attempt's files.
    assert drop_copies(peers, new) == sum(e.size for e in new.files)
    assert peers.find_manifest(new.name) is None
    assert not any(p.exists() for p in new_copies) and all(p.exists() for p in old_copies)


# -- the replica namespace in a hot root -------------------------------------------------------


def test_keys_under_replicas_are_replica_keys_but_a_publish_temporary_stays_one(tmp_path: Path) -> None:
    for key in (
        f"replicas/checkpoints/{NAME}/{ATTEMPT}/__0_0.distcp",
        f"replicas/checkpoints/{NAME}/{ATTEMPT}/parity/l0-s1.bin",
        f"replicas/manifests/{NAME}.json",
        f"replicas/{record_key(NAME, ATTEMPT)}",
    ):
        assert layout.kind_of(key) is layout.KeyKind.REPLICA, key
    # The key a real publish's temporary has under replicas/ (from the local backend): debris
    # that gc may remove, not a copy some node relies on.
    hot = Tier("hot", str(tmp_path / "hot"))
    writer = hot.backend.open_write(f"replicas/manifests/{NAME}.json")
    writer.write(b"{}")
    [temporary] = files_under(tmp_path / "hot")
    key = temporary.relative_to(tmp_path / "hot").as_posix()
    writer.abort()
    assert key.startswith("replicas/manifests/.") and ".tmp-" in key
    assert layout.kind_of(key) is layout.KeyKind.TEMPORARY
    # The node's own files, beside the namespace, are not copies.
    assert layout.kind_of(f"checkpoints/{NAME}/{ATTEMPT}/__0_0.distcp") is layout.KeyKind.DATA
