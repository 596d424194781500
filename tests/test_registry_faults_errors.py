from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from tierstore.errors import (
    BackendNotFound,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigError,
    FaultInjected,
    ObjectNotFound,
    StorageError,
    TierstoreError,
)
from tierstore.storage import faults, registry
from tierstore.storage.local import LocalBackend


def test_plain_paths_and_file_urls_resolve_to_local(tmp_path) -> None:
    assert isinstance(registry.open_backend(str(tmp_path)), LocalBackend)
    assert isinstance(registry.open_backend(tmp_path), LocalBackend)
    b = registry.open_backend(f"file://{tmp_path}", label="hot")
    assert isinstance(b, LocalBackend) and b.label == f"hot file://{tmp_path}"


def test_unknown_scheme_names_the_package_to_install(monkeypatch) -> None:
    registry.registered_backends()  # load entry points, then hide any installed S3 plugin
    monkeypatch.setattr(registry, "_registry", {k: v for k, v in registry._registry.items() if k != "s3"})
    with pytest.raises(BackendNotFound, match="pip install tierstore-s3"):
        registry.open_backend("s3://bucket/run1")
    with pytest.raises(BackendNotFound, match="entry-point group"):
        registry.open_backend("nosuchscheme://bucket/x")


def test_register_backend_conflicts_raise(monkeypatch) -> None:
    registry.registered_backends()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    registry.register_backend("unit-test", LocalBackend)
    registry.register_backend("unit-test", LocalBackend)  # same again: fine
    with pytest.raises(ConfigError, match="already registered"):
        registry.register_backend("unit-test", "somewhere:Else")
    registry.register_backend("unit-test", "somewhere:Else", replace=True)
    with pytest.raises(BackendNotFound, match="failed to import"):
        registry.backend_class("unit-test")
    with pytest.raises(ConfigError):
        registry.register_backend("bad scheme!", LocalBackend)


def test_registered_view_is_read_only() -> None:
    view = registry.registered_backends()
    assert "file" in view
    with pytest.raises(TypeError):
        view["x"] = "y"  # type: ignore[index]


def test_error_tree_and_pickling() -> None:
    err = ChecksumMismatch("CRC32C mismatch", checkpoint="c", file="f", tier="hot /x",
                           expected="0a", actual="0b")
    assert isinstance(err, TierstoreError) and isinstance(err, ValueError)
    assert "checkpoint 'c'" in str(err) and "file 'f'" in str(err) and "tier 'hot /x'" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ChecksumMismatch and str(back) == str(err) and back.actual == "0b"
    assert issubclass(ObjectNotFound, FileNotFoundError) and issubclass(ObjectNotFound, StorageError)
    assert issubclass(CheckpointNotFound, FileNotFoundError)


def test_fault_points_raise_on_the_chosen_hit() -> None:
    faults.point("x.y")  # unarmed: nothing
    faults.arm("x.*", hit=2)
    faults.point("x.y")
    with pytest.raises(FaultInjected, match="x.z"):
        faults.point("x.z")
    faults.point("x.y")  # fired once; spent


def test_fault_spec_parsing() -> None:
    specs = faults.parse_spec("a.b@3=kill; *=raise")
    assert [(s.pattern, s.hit, s.action) for s in specs] == [("a.b", 3, "kill"), ("*", 1, "raise")]
    for bad in ["a=boom", "@2=kill", "a@x=kill"]:
        with pytest.raises(ConfigError):
            faults.parse_spec(bad)


def test_fault_kill_from_environment_and_trace(tmp_path) -> None:
    trace = tmp_path / "trace"
    code = "from tierstore import faults\nfaults.point('a')\nfaults.point('b')\nprint('survived')"
    env = {"TIERSTORE_FAULTS": "b=kill", "TIERSTORE_FAULT_TRACE": str(trace), "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -9 and "survived" not in proc.stdout
    assert [line.split()[1] for line in trace.read_text().splitlines()] == ["a", "b"]
