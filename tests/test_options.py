"""The options objects (tierstore/options.py): every bad option is refused where it is built,
the keywords they replaced still work for one release with one DeprecationWarning each,
FileSystemWriter's arguments still work without one, and one option given both ways is an error."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import assert_same, blank, load, state_for
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import SerializationFormat

import tierstore
from tierstore import (
    CheckpointManager,
    ConfigError,
    ReaderOptions,
    Retention,
    RunOptions,
    StagingOptions,
    TieredReader,
    TieredWriter,
    WriterOptions,
)
from tierstore.format import layout
from tierstore.format.manifest import Manifest


class Identity(StreamTransformExtension):
    """A DCP stream transform that changes nothing: enough to be one."""

    @staticmethod
    def registry_name() -> str:
        return "test.identity"

    @staticmethod
    def from_descriptor(version: str) -> Identity:
        return Identity()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def committed(writer: TieredWriter) -> Manifest:
    assert writer.manifest is not None, "the save did not commit"
    return writer.manifest


def loads_as_plain_dcp(hot: str, writer: TieredWriter, step: int) -> bool:
    """Whether the checkpoint is dcp-encoded: DCP's own FileSystemReader loads its attempt."""
    manifest = committed(writer)
    state = blank()
    attempt = Path(hot) / layout.attempt_prefix(manifest.name, manifest.attempt)
    dcp.load(state, storage_reader=dcp.FileSystemReader(attempt))
    assert_same(state, state_for(step))
    return True


# -- every bad option is refused where it is built, naming it -----------------------------------

BAD: list[tuple[Callable[[], object], str]] = [
    (lambda: WriterOptions(encoding="rawx"), r"WriterOptions\.encoding must be 'raw' or 'dcp', got 'rawx'"),  # type: ignore[arg-type]
    (lambda: WriterOptions(thread_count=0), r"WriterOptions\.thread_count must be a positive int, got 0"),
    (lambda: WriterOptions(thread_count=True), r"WriterOptions\.thread_count .* got True"),
    (lambda: WriterOptions(thread_count="4"), r"WriterOptions\.thread_count .* got '4'"),  # type: ignore[arg-type]
    (lambda: WriterOptions(single_file_per_rank="yes"), r"single_file_per_rank must be True or False"),  # type: ignore[arg-type]
    (lambda: WriterOptions(manifest_part_ranks=0), r"WriterOptions\.manifest_part_ranks .* got 0"),
    (lambda: WriterOptions(max_files_per_dir=-1), r"WriterOptions\.max_files_per_dir .* got -1"),
    (lambda: WriterOptions(extensions=[object()]), r"StreamTransformExtension objects .* got object"),  # type: ignore[list-item]
    (lambda: WriterOptions(extensions="zstd"), r"WriterOptions\.extensions must be a sequence"),  # type: ignore[arg-type]
    (lambda: WriterOptions(encoding="raw", extensions=[Identity()]), r"extensions need encoding='dcp'"),
    (lambda: ReaderOptions(thread_count=0), r"ReaderOptions\.thread_count must be a positive int, got 0"),
    (lambda: ReaderOptions(lease="no"), r"ReaderOptions\.lease must be True or False, got 'no'"),  # type: ignore[arg-type]
    (lambda: ReaderOptions(resolve_once=None), r"ReaderOptions\.resolve_once must be True or False"),  # type: ignore[arg-type]
    (lambda: StagingOptions(mode="fork"), r"StagingOptions\.mode must be 'thread' or 'process', got 'fork'"),  # type: ignore[arg-type]
    (lambda: StagingOptions(buffers="pinned"), r"StagingOptions\.buffers must be 'reuse' or 'fresh'"),  # type: ignore[arg-type]
    (lambda: StagingOptions(async_save="yes"), r"StagingOptions\.async_save must be True or False"),  # type: ignore[arg-type]
    (lambda: StagingOptions(overlap=1), r"StagingOptions\.overlap must be True or False, got 1"),  # type: ignore[arg-type]
    (
        lambda: StagingOptions(buffers="fresh", overlap=True),
        r"overlap needs async_save=True and buffers='reuse'",
    ),
    (lambda: StagingOptions(async_save=False, overlap=True), r"overlap needs .*\(got async_save=False"),
    (lambda: Retention(hot=2), r"Retention\(hot=\) takes a policy .* got int"),  # type: ignore[arg-type]
    (lambda: Retention(cold=None), r"Retention\(cold=\) takes a policy .* got NoneType"),  # type: ignore[arg-type]
    (
        lambda: Retention(hot_min_free="10G"),
        r"Retention\(hot_min_free=\) takes a number of bytes .* got '10G'",
    ),  # type: ignore[arg-type]
    (lambda: Retention(hot_min_free=-1), r"Retention\(hot_min_free=\) .* got -1"),
    (lambda: Retention(hot_min_free=1.5), r"Retention\(hot_min_free=\) .* got 1.5"),  # type: ignore[arg-type]
    (
        lambda: RunOptions("a/b"),
        r"RunOptions: name 'a/b' is not a run name: 1 to 128 printable characters, no '/'",
    ),
    (lambda: RunOptions(""), r"RunOptions: name '' is not a run name"),
    (lambda: RunOptions("x" * 129), r"RunOptions: name 'x+\.\.\. is not a run name"),
    (lambda: RunOptions("new\nline"), r"RunOptions: name 'new\\nline' is not a run name"),
    (lambda: RunOptions("B "), r"RunOptions: name 'B ' is not a run name: .* no space at either end"),
    (lambda: RunOptions(7), r"RunOptions: name 7 is not a run name"),  # type: ignore[arg-type]
    (lambda: RunOptions("B", strict="yes"), r"RunOptions\.strict must be True or False, got 'yes'"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("build, message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_an_ill_typed_option_is_a_config_error_naming_it_when_built(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_an_unknown_option_is_a_type_error_when_built(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    with pytest.raises(TypeError, match="thread_cont"):
        WriterOptions(thread_cont=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="fork"):
        StagingOptions(fork=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="TieredWriter.* unexpected keyword argument 'thread_cont'"):
        TieredWriter(hot, step=1, thread_cont=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="TieredReader.* unexpected keyword argument 'leese'"):
        TieredReader(hot, leese=False)  # type: ignore[call-arg]
    with pytest.raises(
        ConfigError, match=r"TieredReader\(options=\) takes a ReaderOptions, got WriterOptions"
    ):
        TieredReader(hot, options=WriterOptions())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CheckpointManager.* unexpected keyword argument 'async_mod'"):
        CheckpointManager(hot, async_mod="thread")  # type: ignore[call-arg]
    with pytest.raises(
        ConfigError, match=r"CheckpointManager\(writer=\) takes a WriterOptions, got StagingOptions"
    ):
        CheckpointManager(hot, writer=StagingOptions())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"CheckpointManager\(staging=\) takes a StagingOptions, got dict"):
        CheckpointManager(hot, staging={"mode": "thread"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"TieredWriter\(options=\) takes a WriterOptions"):
        TieredWriter(hot, step=1, options={"thread_count": 2})  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"CheckpointManager\(run=\) takes a run name or a tierstore.RunOptions, got dict"
    ):
        CheckpointManager(hot, run={"name": "B"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"RunOptions: name 'a/b' is not a run name"):
        CheckpointManager(hot, run="a/b")
    assert not Path(hot).exists()  # all refused before anything was made


def test_an_unset_limit_comes_from_the_environment_read_when_the_writer_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot = str(tmp_path / "hot")
    monkeypatch.setenv("TIERSTORE_MANIFEST_PART_RANKS", "3")
    monkeypatch.setenv("TIERSTORE_MAX_FILES_PER_DIR", "7")
    writer = TieredWriter(hot, step=1)
    assert (writer.manifest_part_ranks, writer.max_files_per_dir) == (3, 7)
    writer = TieredWriter(hot, step=1, options=WriterOptions(manifest_part_ranks=5, max_files_per_dir=9))
    assert (writer.manifest_part_ranks, writer.max_files_per_dir) == (5, 9)  # the option wins
    monkeypatch.setenv("TIERSTORE_MANIFEST_PART_RANKS", "lots")
    with pytest.raises(ConfigError, match="TIERSTORE_MANIFEST_PART_RANKS='lots'"):
        TieredWriter(hot, step=1)
    with pytest.raises(ConfigError, match="TIERSTORE_MANIFEST_PART_RANKS='lots'"):
        CheckpointManager(hot)  # the manager's own writer is built with it, not at the first save
    assert not Path(hot).exists()


def test_options_are_frozen_values_that_travel_with_a_pickled_writer(tmp_path: Path) -> None:
    options = WriterOptions(thread_count=2, encoding="dcp", extensions=[Identity()])
    assert isinstance(options.extensions, tuple) and options.resolved_encoding == "dcp"
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(AttributeError):
        options.thread_count = 3  # type: ignore[misc]
    writer = pickle.loads(
        pickle.dumps(TieredWriter(str(tmp_path), step=1, options=WriterOptions(thread_count=2)))
    )
    assert writer.options == WriterOptions(thread_count=2) and writer.thread_count == 2
    assert WriterOptions().resolved_encoding == "raw"
    assert WriterOptions(extensions=[Identity()]).resolved_encoding == "dcp"  # as FileSystemWriter's


def test_the_options_are_exported_and_import_no_torch() -> None:
    assert {"WriterOptions", "ReaderOptions", "StagingOptions", "RunOptions", "MigrationOptions"} <= set(
        tierstore.__all__
    )
    assert (
        tierstore.RunOptions is RunOptions
        and RunOptions("B") == RunOptions("B", strict=False)
        and hash(RunOptions("B", strict=True))
    )
    assert tierstore.ReaderOptions is ReaderOptions
    assert tierstore.WriterOptions is WriterOptions and tierstore.StagingOptions is StagingOptions
    code = "import sys, tierstore.options; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- FileSystemWriter's arguments: no warning, folded into the options --------------------------


def test_filesystem_writer_arguments_work_without_a_warning(tmp_path: Path) -> None:
    hot = str(tmp_path / "hot")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        writer = TieredWriter(
            path=hot,
            step=1,
            thread_count=2,
            single_file_per_rank=False,
            sync_files=True,
            per_thread_copy_ahead=0,
            cache_staged_state_dict=False,
            overwrite=True,
            _extensions=None,
            serialization_format=SerializationFormat.TORCH_SAVE,
        )
        dcp.save(state_for(1), storage_writer=writer)
    assert writer.options == WriterOptions(thread_count=2, single_file_per_rank=False)
    assert writer.overwrite is True
    data = [f for f in committed(writer).files if f.path != layout.METADATA_FILE]
    assert len(data) > 2  # one file per item, not one per thread: single_file_per_rank=False
    assert_same(load(hot)[0], state_for(1))


def test_filesystem_writer_extensions_are_folded_and_choose_the_dcp_encoding(tmp_path: Path) -> None:
    hot, ext = str(tmp_path / "hot"), Identity()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        writer = TieredWriter(hot, step=1, _extensions=[ext], options=WriterOptions(thread_count=2))
    assert writer.options == WriterOptions(thread_count=2, extensions=(ext,))
    assert (writer.encoding, writer.extensions) == ("dcp", (ext,))


# -- one option given both ways ----------------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda hot: TieredWriter(hot, step=1, thread_count=2, options=WriterOptions(thread_count=3)),
            r"TieredWriter got thread_count=2 and options=WriterOptions\(thread_count=3\): give thread_count once",
        ),
        (
            lambda hot: TieredWriter(
                hot, step=1, _extensions=[Identity()], options=WriterOptions(extensions=[Identity()])
            ),
            r"got _extensions=.* and options=WriterOptions\(extensions=",
        ),
    ],
    ids=[
        "fs-argument",
        "extensions",
    ],
)
def test_one_option_given_both_ways_is_a_config_error(
    tmp_path: Path, build: Callable[[str], Any], message: str
) -> None:
    hot = str(tmp_path / "hot")
    with pytest.raises(ConfigError, match=message):
        build(hot)
    assert not Path(hot).exists()


def test_an_option_at_its_default_is_not_given_twice(tmp_path: Path) -> None:
    # A frozen dataclass does not say which fields were passed: at its default, the argument wins.
    writer = TieredWriter(
        str(tmp_path), step=1, thread_count=2, options=WriterOptions(encoding="dcp", thread_count=1)
    )
    assert writer.options == WriterOptions(encoding="dcp", thread_count=2)
