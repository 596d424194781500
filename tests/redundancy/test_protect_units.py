"""The parts of a protection round that decide what is trusted, on their own (issue 37): what
the round's reports prove (`_record`), and the check of a parity sender's own files
(`_SentCheck`, `_ConcatSource`). The rounds themselves run in real jobs: test_copies_*.py."""

from __future__ import annotations

from pathlib import Path

import crc32c

from tierstore.format.manifest import FileEntry, Manifest
from tierstore.redundancy.protect import _ConcatSource, _record, _Report, _SentCheck
from tierstore.redundancy.schemes import Parity, Replicas, Topology
from tierstore.tiers.tier import Tier


def _entry(path: str, data: bytes, rank: int) -> FileEntry:
    return FileEntry(path, len(data), crc32c.crc32c(data), rank)


def _manifest(files: list[FileEntry], world: int) -> Manifest:
    return Manifest(
        name="step-0000000001",
        step=1,
        attempt="20261205T000000Z-00000000",
        world_size=world,
        created=1.0,
        files=tuple(files),
    )


META = _entry(".metadata", b"meta", 0)


def test_a_rank_that_wrote_no_file_is_protected_where_its_placement_says() -> None:
    # DDP-style state: DCP wrote every tensor on rank 0; ranks 1-3 have nothing to copy. The
    # checkpoint is protected by 2 copies once rank 0's files verified on its peer (before the
    # fix, no copy of the empty ranks ever "verified" and nothing was ever protected).
    topology = Topology(4, 2)
    manifest = _manifest([META, _entry("__0_0.distcp", b"weights", 0)], 4)
    reports = [_Report(rank) for rank in range(4)]
    reports[2].verified[0] = True  # rank 0's copy arrived whole on rank 2 (node 1)
    record = _record(Replicas(2), topology, manifest, reports)
    assert record.copies == 2 and record.holders == {0: [0, 1], 1: [0, 1], 2: [1, 0], 3: [1, 0]}
    reports[2].verified[0] = False  # and when it did not, nothing is protected
    assert _record(Replicas(2), topology, manifest, reports).copies == 1


def test_a_metadata_copy_that_failed_leaves_the_checkpoint_unprotected() -> None:
    # Node 1 could not open the checkpoint without the cold tier: it is not protected.
    topology = Topology(4, 2)
    files = [META] + [_entry(f"__{r}_0.distcp", bytes([r]) * 8, r) for r in range(4)]
    reports = [_Report(rank, verified={(rank + 2) % 4: True}) for rank in range(4)]
    assert _record(Replicas(2), topology, _manifest(files, 4), reports).copies == 2
    reports[2].metadata_ok = False
    assert _record(Replicas(2), topology, _manifest(files, 4), reports).copies == 1
    assert _record(Parity(1, 1), Topology(2, 1), _manifest(files[:3], 2), reports[:2]).copies == 2
    parity = [_Report(0), _Report(1, metadata_ok=False)]
    assert _record(Parity(1, 1), Topology(2, 1), _manifest(files[:3], 2), parity).copies == 1


def test_a_parity_sender_finds_a_file_of_its_own_that_does_not_match_the_manifest(tmp_path: Path) -> None:
    # Parity encodes whatever it is sent: a byte gone bad on the sender's disk would be
    # encoded into every parity block and found only at a restore, too late. The sender
    # checks its files as it reads them; a mismatch fails the round (not protected).
    good, other = b"a" * 1000, b"b" * 700
    entries = [_entry("__1_0.distcp", good, 1), _entry("__1_1.distcp", other, 1)]
    manifest = _manifest([META, *entries], 2)
    hot = Tier("hot", str(tmp_path / "hot"))
    for entry, data in zip(entries, (good, other)):
        with hot.backend.open_write(hot.file_key(manifest.name, manifest.attempt, entry.path)) as out:
            out.write(data)

    def read_all(check: _SentCheck, chunks: list[tuple[int, int]]) -> bytes:
        out = b""
        for start, length in chunks:  # consecutive chunks, as stripes take them
            source = _ConcatSource(hot, manifest, entries, start, length, length + 3, check)
            out += source.read(length + 3)[:length]
            source.close()
        return out

    check = _SentCheck(entries)
    assert read_all(check, [(0, 850), (850, 850)]) == good + other and check.errors == []
    again = _SentCheck(entries)  # a second holder's pass out of order feeds nothing twice
    again.feed(500, good[500:])
    assert again.errors == [] and again._pos == 0
    path = tmp_path / "hot" / hot.file_key(manifest.name, manifest.attempt, "__1_1.distcp")
    damaged = bytearray(path.read_bytes())
    damaged[10] ^= 0xFF
    path.write_bytes(bytes(damaged))
    check = _SentCheck(entries)
    read_all(check, [(0, 850), (850, 850)])
    assert len(check.errors) == 1 and "__1_1.distcp" in check.errors[0], check.errors
    path.unlink()  # a file gone: zeros are sent, and the check says why
    check = _SentCheck(entries)
    assert read_all(check, [(0, 850), (850, 850)])[1000:] == bytes(700)
    assert check.errors and "reading to encode failed" in check.errors[0], check.errors
