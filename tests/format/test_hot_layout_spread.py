"""Hot directory spreading: a save whose attempt directory would hold more than
``max_files_per_dir`` shard files puts them in ``r<k>/`` subdirectories by rank.

Proves: no directory holds more than the threshold; the manifest records the relative paths,
so loading (hot and cold), migrating, listing and gc work unchanged; a ``dcp``-encoded
attempt directory is still a plain DCP checkpoint ``FileSystemReader`` loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from simulated_ranks import holds_saved, load_state, save_ranks

from tierstore import Store, TieredReader, WriterOptions, list_checkpoints
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.gc import find_garbage
from tierstore.migration.migrator import MigrationOptions
from tierstore.retry import RetryPolicy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAST = MigrationOptions(
    chunk_size=4096,
    poll_interval=0.01,
    commit_timeout=10,
    retry=RetryPolicy(attempts=3, initial=0.001, maximum=0.01),
)


@pytest.mark.parametrize(
    "files_per_rank, ranks, limit, per_dir",
    [
        (1, 10, 10, 0),  # fits: one directory, as before
        (1, 12, 10, 10),
        (1, 16384, 4096, 1000),
        (3, 16384, 4096, 1000),
        (5, 16384, 4096, 100),
        (5000, 2, 4096, 1),  # a rank alone over the limit still gets a directory of its own
    ],
)
def test_ranks_per_directory(files_per_rank: int, ranks: int, limit: int, per_dir: int) -> None:
    assert layout.ranks_per_dir(files_per_rank, ranks, limit) == per_dir
    if per_dir:
        assert per_dir * files_per_rank <= max(limit, files_per_rank)


def test_shard_names() -> None:
    assert layout.data_file_name(12345, 2, 1000) == "r012/__12345_2.distcp"
    assert layout.data_file_name(7, 0, 1000) == "r000/__7_0.distcp"
    assert layout.data_file_name(7, 0) == "__7_0.distcp"


def _attempt_dir(root: str, manifest: Manifest) -> Path:
    return Path(root) / layout.attempt_prefix(manifest.name, manifest.attempt)


def _directory_sizes(top: Path) -> dict[str, int]:
    return {
        str(d.relative_to(top)): sum(1 for _ in d.iterdir())
        for d in [top, *[p for p in top.rglob("*") if p.is_dir()]]
    }


@pytest.mark.parametrize("threads, limit, part_ranks", [(1, 10, 1024), (2, 20, 4)])
def test_a_wide_save_spreads_its_shards_and_everything_else_works_unchanged(
    tmp_path: Path, threads: int, limit: int, part_ranks: int
) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    manifest, writers = save_ranks(
        12,
        hot,
        cold,
        thread_count=threads,  # FileSystemWriter's argument, beside the options
        options=WriterOptions(max_files_per_dir=limit, manifest_part_ranks=part_ranks),
        migration=FAST,
    )
    assert writers[0].migrator is not None and writers[0].migrator.wait(30)
    assert manifest.file("r001/__11_0.distcp") is not None  # ranks 10-19
    assert manifest.file("r000/__9_0.distcp") is not None
    shards = [f for f in manifest.files if f.path != manifest.metadata_file]
    assert len(shards) == 12 * threads and all(f.path.startswith("r0") for f in shards)
    for root in (hot, cold):
        top = _attempt_dir(root, manifest)
        sizes = _directory_sizes(top)
        assert max(sizes.values()) <= limit and set(sizes) == {".", "r000", "r001"}, sizes
        assert {p.name for p in top.iterdir() if p.is_file()} == {
            ".metadata",
            *(ref.path for ref in manifest.parts),
        }
    [info] = list_checkpoints(Store.of(hot, cold))
    assert info.tiers == ("hot", "cold") and info.num_files == 12 * threads + 1
    for tiers in ((hot, None), (None, cold)):
        state = load_state(12)
        dcp.load(state, storage_reader=TieredReader(*tiers, step=1))
        assert holds_saved(state, 12)
    assert find_garbage(Store.of(hot, cold), grace=0) == []  # parts and spread shards are no garbage


def test_a_narrow_save_keeps_one_directory(tmp_path: Path) -> None:
    manifest, _ = save_ranks(4, str(tmp_path / "hot"), options=WriterOptions(max_files_per_dir=10))
    assert sorted(f.path for f in manifest.files) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]


def test_a_spread_dcp_attempt_is_still_plain_dcp(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    manifest, _ = save_ranks(6, hot, options=WriterOptions(max_files_per_dir=4, encoding="dcp"))
    assert manifest.file("r000/__0_0.distcp") is not None
    state = load_state(6)
    dcp.load(state, storage_reader=dcp.FileSystemReader(_attempt_dir(hot, manifest)))
    assert holds_saved(state, 6)


def test_the_threshold_comes_from_the_argument_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_MAX_FILES_PER_DIR", "2")
    manifest, _ = save_ranks(3, str(tmp_path / "a"))
    assert manifest.file("r002/__2_0.distcp") is not None
    manifest, _ = save_ranks(3, str(tmp_path / "b"), options=WriterOptions(max_files_per_dir=3))
    assert manifest.file("__2_0.distcp") is not None
    with pytest.raises(ConfigError, match="max_files_per_dir"):
        save_ranks(1, str(tmp_path / "c"), options=WriterOptions(max_files_per_dir=0))


# -- object-store key prefixes ----------------------------------------------------------------


def test_a_grouped_attempt_spreads_by_rank_group_and_an_old_one_keeps_its_keys() -> None:
    import hashlib

    old, grouped = "20261129T081814Z-3fa2b1c4", "20261129T081814Z-3fa2b1c4-g"
    path = layout.data_file_name(70, 0)
    rest = f"step-0000000001/{old}/{path}"
    # Attempts from before (and dcp-encoded ones) keep the key tierstore 0.2 computes.
    assert (
        layout.file_key("step-0000000001", old, path, spread=True)
        == f"shards/{hashlib.sha1(rest.encode()).hexdigest()[:2]}/{rest}"
    )
    prefixes = {
        layout.file_key("step-0000000001", grouped, layout.data_file_name(r, i, per_dir), spread=True).split(
            "/"
        )[1]
        for r in range(256)
        for i in range(3)
        for per_dir in (0, 100)
    }
    assert len(prefixes) <= 256 // layout.RANKS_PER_PREFIX
    same = {
        layout.file_key("step-0000000001", grouped, layout.data_file_name(r, 0), spread=True).split("/")[1]
        for r in range(64, 128)
    }
    assert len(same) == 1  # ranks 64..127: one group, one prefix
    assert layout.new_attempt(grouped=True).endswith("-g")
    assert layout.check_attempt(grouped) == grouped
    with pytest.raises(ConfigError):
        layout.check_attempt(old + "-h")
