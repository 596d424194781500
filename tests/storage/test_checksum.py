"""CRC32C combine: the checksum of a concatenation from the checksums of its parts."""

from __future__ import annotations

import random

import crc32c
import pytest

from tierstore.storage.checksum import crc32c_combine, crc32c_update
from tierstore.storage.memory import MemoryBackend


@pytest.mark.parametrize("seed", range(20))
def test_combine_equals_the_crc32c_of_the_concatenation(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [0, 1, 3, 4096, 1 << 20, rng.randrange(1, 1 << 16), rng.randrange(1 << 16, 3 << 20)]
    for len_a in (rng.choice(lengths), 0):
        for len_b in lengths:
            a, b = rng.randbytes(len_a), rng.randbytes(len_b)
            assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combine_folds_many_blocks_into_the_whole() -> None:
    rng = random.Random(7)
    blocks = [rng.randbytes(rng.choice([0, 1, 4095, 4096, 70_000])) for _ in range(40)]
    whole = 0
    for block in blocks:
        whole = crc32c_combine(whole, crc32c_update(0, block), len(block))
    assert whole == crc32c.crc32c(b"".join(blocks))


def test_combine_refuses_a_negative_length() -> None:
    with pytest.raises(ValueError):
        crc32c_combine(1, 2, -1)


def test_object_writer_given_block_checksums_records_the_file_checksum() -> None:
    # What the raw writer does: CRC32C each block once, hand it over with the bytes.
    backend = MemoryBackend("memory://test-checksum")
    rng = random.Random(3)
    parts = [rng.randbytes(n) for n in (5000, 0, 1 << 20, 3)]
    with backend.open_write("k") as out:
        for part in parts:
            out.write(part, crc32c=crc32c_update(0, part))
    assert out.crc32c == crc32c.crc32c(b"".join(parts)) and out.size == sum(map(len, parts))
    assert backend.read_bytes("k") == b"".join(parts)
