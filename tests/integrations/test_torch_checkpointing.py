"""tierstore as torch_checkpointing's storage (``tierstore.integrations.torch_checkpointing``),
on real local directories (issue 22, item 5): its hot tier is a local directory, never a URL
(mistyped or not), and its streamed read falls back to the cold tier when the hot copy is
damaged or missing, naming file and tier when no copy is good.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.tiers.tier import Tier


@pytest.mark.parametrize("hot", ["s3:/bucket/run", "s3://bucket/run", "file:///data/run"])
def test_the_torch_checkpointing_hot_tier_is_a_local_directory(cwd: Path, hot: str) -> None:
    from tierstore.integrations.torch_checkpointing import TieredStorageConfig

    with pytest.raises(ConfigError, match="bucket/run|data/run"):
        TieredStorageConfig(hot=hot, run_id="outside").create_storage()
    assert list(cwd.iterdir()) == []


def tc_storage(tmp_path: Path) -> object:
    from tierstore.integrations.torch_checkpointing import TieredStorageConfig

    return TieredStorageConfig(
        hot=str(tmp_path / "hot"), cold=str(tmp_path / "cold"), run_id="outside"
    ).create_storage()


def tc_committed(tmp_path: Path, data: bytes) -> tuple[object, Path]:
    """A checkpoint ``step_5`` of one file, committed in hot and migrated to cold."""
    from tierstore.migration import workers

    storage = tc_storage(tmp_path)
    hot = tmp_path / "hot"
    with storage.stream_write(hot / "tmp_step_5" / "model.pt") as out:  # type: ignore[attr-defined]
        out.write(data)
    storage.rename(hot / "tmp_step_5", hot / "step_5", is_directory=True)  # type: ignore[attr-defined]
    assert workers.drain(60)
    manifest = Tier("cold", str(tmp_path / "cold")).find_manifest("step_5")
    assert manifest is not None
    return storage, Path(hot, layout.file_key("step_5", manifest.attempt, "model.pt"))


def streamed(storage: object, path: Path) -> bytes:
    from torch_checkpointing.storage.base_storage import ReadArgs

    with storage.stream_read(path, ReadArgs(pre_read_full_file=False)) as stream:  # type: ignore[attr-defined]
        return bytes(stream.read())


def test_torch_checkpointing_streamed_read_falls_back_to_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = os.urandom(300_000)
    storage, hot_copy = tc_committed(tmp_path, data)
    damaged = bytearray(hot_copy.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    hot_copy.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING):
        assert streamed(storage, tmp_path / "hot" / "step_5" / "model.pt") == data
    assert "model.pt" in caplog.text
    hot_copy.unlink()  # missing in hot: cold again
    assert streamed(tc_storage(tmp_path), tmp_path / "hot" / "step_5" / "model.pt") == data


def test_torch_checkpointing_streamed_read_without_a_good_copy_names_file_and_tier(tmp_path: Path) -> None:
    from tierstore.errors import ChecksumMismatch

    storage, hot_copy = tc_committed(tmp_path, os.urandom(1000))
    cold_copy = tmp_path / "cold" / hot_copy.relative_to(tmp_path / "hot")
    for copy in (hot_copy, cold_copy):
        damaged = bytearray(copy.read_bytes())
        damaged[10] ^= 0x01
        copy.write_bytes(bytes(damaged))
    with pytest.raises(ChecksumMismatch) as raised:
        streamed(storage, tmp_path / "hot" / "step_5" / "model.pt")
    err = raised.value
    assert err.checkpoint == "step_5" and err.file == "model.pt" and err.tier is not None
    assert err.tier.startswith("cold")
