"""DCP parity (issue 17 item 3): a FileSystemWriter/FileSystemReader user switches to
TieredWriter/TieredReader by changing the class, and gets DCP's arguments, errors and
compression extensions with DCP's meaning (or a message that says what to do instead)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import committed, flip, unwrap
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

from tierstore.dcp.reader import TieredReader
from tierstore.dcp.writer import TieredWriter
from tierstore.errors import CheckpointExists, ChecksumMismatch, ConfigError
from tierstore.format import layout
from tierstore.storage.checksum import crc32c_update
from tierstore.tiers.catalog import list_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def model_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)},
        "step": seed,
        "sched": {"lr": 0.1 * seed},
    }


def blank_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": -1, "sched": {"lr": 0.0}}


def fs_user_script(writer_cls: type, reader_cls: type, root: str) -> dict[str, Any]:
    """What a FileSystemWriter user writes: one directory per checkpoint under ``root``,
    named by checkpoint_id, DCP's writer arguments spelled out; then load the last one."""
    for step in (1, 2):
        writer = writer_cls(
            path=root,
            single_file_per_rank=True,
            sync_files=True,
            thread_count=2,
            per_thread_copy_ahead=10_000_000,
            cache_staged_state_dict=False,
            overwrite=False,
            serialization_format=SerializationFormat.TORCH_SAVE,
        )
        dcp.save(model_state(step), checkpoint_id=os.path.join(root, f"step-{step}"), storage_writer=writer)
    target = blank_state()
    dcp.load(target, checkpoint_id=os.path.join(root, "step-2"), storage_reader=reader_cls(path=root))
    return target


def assert_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert torch.equal(actual["model"]["w"], expected["model"]["w"])
    assert torch.equal(actual["model"]["b"], expected["model"]["b"])
    assert (actual["step"], actual["sched"]) == (expected["step"], expected["sched"])


def test_a_filesystem_writer_script_runs_with_only_the_class_changed(tmp_path: Path) -> None:
    plain = fs_user_script(FileSystemWriter, FileSystemReader, str(tmp_path / "plain"))
    tiered = fs_user_script(TieredWriter, TieredReader, str(tmp_path / "tiered"))
    assert_state(plain, model_state(2))
    assert_state(tiered, model_state(2))
    # Each checkpoint_id directory became a committed checkpoint of that name.
    assert sorted(c.name for c in list_checkpoints(str(tmp_path / "tiered"))) == ["step-1", "step-2"]


def test_checkpoint_ids_name_checkpoints_by_name_path_or_file_url(tmp_path: Path) -> None:
    root = tmp_path / "store"
    for checkpoint_id in (
        "by-name",
        str(root / "by-path"),
        f"file://{root}/by-url",
        Path(root, "by-pathlike"),
    ):
        dcp.save(model_state(3), checkpoint_id=checkpoint_id, storage_writer=TieredWriter(str(root)))
    names = sorted(c.name for c in list_checkpoints(str(root)))
    assert names == ["by-name", "by-path", "by-pathlike", "by-url"]
    target = blank_state()
    dcp.load(target, checkpoint_id=str(root / "by-path"), storage_reader=TieredReader(str(root)))
    assert_state(target, model_state(3))


@pytest.mark.parametrize("where", ["elsewhere", "nested", "relative-dots"])
def test_a_checkpoint_id_outside_the_root_fails_inside_checkpoint_exception(
    tmp_path: Path, where: str
) -> None:
    root = tmp_path / "store"
    dcp.save(model_state(1), storage_writer=TieredWriter(str(root), step=1))
    bad = {
        "elsewhere": str(tmp_path / "other" / "step-1"),
        "nested": str(root / "a" / "step-1"),
        "relative-dots": "../step-1",
    }[where]
    with pytest.raises(CheckpointException) as saving:
        dcp.save(model_state(2), checkpoint_id=bad, storage_writer=TieredWriter(str(root)))
    with pytest.raises(CheckpointException) as loading:
        dcp.load(blank_state(), checkpoint_id=bad, storage_reader=TieredReader(str(root)))
    for caught in (saving, loading):
        err = unwrap(caught.value)
        assert isinstance(err, ConfigError) and "is not a checkpoint name" in str(err)
        assert str(root) in str(err)  # says which root a path must be under
    assert [c.step for c in list_checkpoints(str(root))] == [1]  # nothing else written


def test_the_overwrite_refusal_uses_dcps_words_then_ours(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    dcp.save(model_state(1), storage_writer=FileSystemWriter(plain, overwrite=False))
    with pytest.raises(CheckpointException) as theirs:
        dcp.save(model_state(1), storage_writer=FileSystemWriter(plain, overwrite=False))
    assert "Checkpoint already exists" in str(unwrap(theirs.value))
    root = str(tmp_path / "tiered")
    dcp.save(model_state(1), storage_writer=TieredWriter(root, step=1))
    for overwrite in (False, True):
        with pytest.raises(CheckpointException) as ours:
            dcp.save(model_state(9), storage_writer=TieredWriter(path=root, step=1, overwrite=overwrite))
        err = unwrap(ours.value)
        assert isinstance(err, CheckpointExists)
        assert str(err).startswith("Checkpoint already exists")
        assert "never overwritten" in str(err) and err.checkpoint == "step-0000000001"
    target = blank_state()
    dcp.load(target, storage_reader=TieredReader(root))
    assert_state(target, model_state(1))  # the committed one is untouched


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(sync_files=False), "durable before the commit"),
        (dict(cache_staged_state_dict=True), "ReusedStaging"),
        (dict(serialization_format=SerializationFormat.SAFETENSORS), "HuggingFaceStorageWriter"),
        (dict(serialization_format="msgpack"), "TORCH_SAVE and SAFETENSORS"),
        (dict(per_thread_copy_ahead=-1), "byte count"),
        (dict(_extensions=[object()]), "StreamTransformExtension"),
        (dict(hot="/tmp/a"), "both hot and path"),
    ],
)
def test_refused_writer_arguments_say_what_to_do(tmp_path: Path, kwargs: dict[str, Any], hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        TieredWriter(path=str(tmp_path), step=1, **kwargs)
    assert not list(tmp_path.iterdir())  # refused before anything was written


class _Deflating(io.RawIOBase):
    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.z = out, zlib.compressobj()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.out.write(self.z.compress(bytes(data)))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.out.write(self.z.flush())
            self.out.close()
        super().close()


class Deflate(StreamTransformExtension):
    """A stream transform through DCP's own extension interface, as ZStandard is."""

    @staticmethod
    def registry_name() -> str:
        return "test.deflate"

    @staticmethod
    def from_descriptor(version: str) -> Deflate:
        return Deflate()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _Deflating(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(zlib.decompress(input.read()))


def compressible() -> dict[str, Any]:
    return {"w": torch.zeros(1 << 18), "b": torch.arange(10), "extra": {"note": "kept"}}


def registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(Deflate)
    return reg


def test_extensions_compress_what_is_stored_checksummed_after_the_transform(tmp_path: Path) -> None:
    root = str(tmp_path)
    dcp.save(compressible(), storage_writer=TieredWriter(path=root, step=1, _extensions=[Deflate()]))
    manifest = committed(root, 1)
    assert manifest.encoding == "dcp"  # chosen for the extensions
    data = [f for f in manifest.files if f.path != manifest.metadata_file]
    stored = Path(root, layout.file_key(manifest.name, manifest.attempt, data[0].path))
    assert stored.stat().st_size < (1 << 20) // 50  # 1 MiB of zeros, compressed
    assert data[0].crc32c == crc32c_update(0, stored.read_bytes())  # of the bytes stored
    target = {"w": torch.ones(1 << 18), "b": torch.zeros(10, dtype=torch.long), "extra": {"note": ""}}
    dcp.load(target, storage_reader=TieredReader(path=root, _extension_registry=registry()))
    assert torch.equal(target["w"], compressible()["w"]) and torch.equal(target["b"], torch.arange(10))
    assert target["extra"] == {"note": "kept"}
    # The attempt is plain DCP: FileSystemReader with the same registry reads it too.
    plain = {"w": torch.ones(1 << 18), "b": torch.zeros(10, dtype=torch.long), "extra": {"note": ""}}
    dcp.load(plain, storage_reader=FileSystemReader(stored.parent, _extension_registry=registry()))
    assert torch.equal(plain["w"], compressible()["w"]) and plain["extra"] == {"note": "kept"}


def test_a_transformed_checkpoint_needs_its_extension_and_intact_bytes(tmp_path: Path) -> None:
    root = str(tmp_path)
    dcp.save(compressible(), storage_writer=TieredWriter(root, step=1, _extensions=[Deflate()]))
    with pytest.raises(CheckpointException) as missing:
        dcp.load(compressible(), storage_reader=TieredReader(root))
    err = unwrap(missing.value)
    assert isinstance(err, ConfigError) and "_extension_registry" in str(err)
    assert "test.deflate/1" in str(err)
    manifest = committed(root, 1)
    data = next(f for f in manifest.files if f.path != manifest.metadata_file)
    flip(Path(root, layout.file_key(manifest.name, manifest.attempt, data.path)), offset=data.size // 2)
    with pytest.raises(CheckpointException) as damaged:
        dcp.load(compressible(), storage_reader=TieredReader(root, _extension_registry=registry()))
    assert isinstance(unwrap(damaged.value), ChecksumMismatch)


def test_zstandard_as_dcp_uses_it(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    dcp.save(compressible(), storage_writer=TieredWriter(str(tmp_path), step=1, _extensions=[ZStandard()]))
    target = {"w": torch.ones(1 << 18), "b": torch.zeros(10, dtype=torch.long), "extra": {"note": ""}}
    dcp.load(target, storage_reader=TieredReader(str(tmp_path)))  # DCP's default registry
    assert torch.equal(target["w"], compressible()["w"]) and target["extra"] == {"note": "kept"}


_READ_ONLY_LOAD = textwrap.dedent("""
    import logging, sys, warnings
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    import torch, torch.distributed.checkpoint as dcp
    from tierstore.dcp.reader import TieredReader
    for _ in range(3):  # an eval job loading again and again
        state = {"w": torch.zeros(8)}
        dcp.load(state, storage_reader=TieredReader(sys.argv[1]))
        assert torch.equal(state["w"], torch.arange(8.0)), state
    print("LOADED")
""")


def test_a_reader_without_write_access_loads_with_one_warning(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        run_read_only_load(tmp_path, [], chmod=True)
        return
    # Root writes anywhere: read as an unprivileged user, from a directory it can reach.
    base = Path(tempfile.mkdtemp(prefix="tierstore-ro-"))
    try:
        base.chmod(0o755)
        (base / "home").mkdir()
        os.chown(base / "home", 65534, 65534)
        run_read_only_load(base, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], chmod=False)
    finally:
        shutil.rmtree(base)


def run_read_only_load(base: Path, command: list[str], *, chmod: bool) -> None:
    root = base / "store"
    dcp.save({"w": torch.arange(8.0)}, storage_writer=TieredWriter(str(root), step=1))
    script = base / "load.py"
    script.write_text(_READ_ONLY_LOAD)
    if chmod:
        for directory, _, _ in os.walk(root):
            os.chmod(directory, 0o555)
    env = {**os.environ, "HOME": str(base / "home")}
    done = subprocess.run(
        [*command, sys.executable, str(script), str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED" in done.stdout
    warned = [line for line in done.stderr.splitlines() if "cannot write leases" in line]
    assert len(warned) == 1 and "read-only" in warned[0] and str(root) in warned[0], done.stderr
    assert not Path(root, layout.LEASE_DIR).exists()  # it really could not write
    if chmod:
        for directory, _, _ in os.walk(root):
            os.chmod(directory, 0o755)
