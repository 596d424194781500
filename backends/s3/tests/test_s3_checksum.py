"""S3's forms of a CRC32C: what counts as a full-object checksum, and what a multipart
object may truthfully report."""

from __future__ import annotations

import os

import pytest

from tierstore.storage.backend import crc32c_update
from tierstore_s3 import _checksum


def test_wire_form_round_trips() -> None:
    for crc in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert _checksum.decode(_checksum.encode(crc)) == crc
    assert _checksum.encode(0) == "AAAAAA=="
    assert _checksum.decode("not base64!") is None
    assert _checksum.decode("AAAAAA==-3") is None


@pytest.mark.parametrize(
    "head, full",
    [
        ({"ChecksumCRC32C": "3q2+7w==", "ETag": '"abc"'}, True),  # single PUT
        ({"ChecksumCRC32C": "3q2+7w==", "ChecksumType": "FULL_OBJECT", "ETag": '"a-2"'}, True),
        ({"ChecksumCRC32C": "3q2+7w==", "ChecksumType": "COMPOSITE", "ETag": '"a-2"'}, False),
        ({"ChecksumCRC32C": "3q2+7w==-2", "ETag": '"a-2"'}, False),
        ({"ChecksumCRC32C": "3q2+7w==", "ETag": '"a-2"'}, False),  # moto's unsuffixed composite
        ({"ETag": '"abc"'}, False),
    ],
)
def test_only_full_object_checksums_are_the_bytes_crc32c(head: dict, full: bool) -> None:
    assert _checksum.full_object_crc32c(head) == (0xDEADBEEF if full else None)


def test_accepted_values_cover_full_and_composite_forms() -> None:
    parts = [os.urandom(1000), os.urandom(10)]
    part_crcs = [crc32c_update(0, p) for p in parts]
    full = crc32c_update(0, parts[0] + parts[1])
    composite = _checksum.composite(part_crcs)
    assert _checksum.accepted_values(full, part_crcs) == {_checksum.encode(full), composite, f"{composite}-2"}
    assert _checksum.accepted_values(full, []) == {_checksum.encode(full)}
