"""Loading runs no code from the store: hostile ``.metadata`` and ``BYTE_IO`` pickles are
refused without running anything, and genuine metadata of real saves still loads."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import unwrap
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import IntegrityError, TieredReader, TieredWriter, WriterOptions
from tierstore.format import layout
from tierstore.format import safe_pickle as _safe_pickle
from tierstore.format.manifest import _checksum
from tierstore.format.safe_pickle import load_metadata
from tierstore.storage.backend import crc32c_update

DCP = "torch.distributed.checkpoint.metadata"
FLAG = "TIERSTORE_PWNED"
RAN: list[str] = []
WATCHING = [False]
_SPAWN = ("os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn", "os.fork")


def _audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    if not WATCHING[0]:
        return
    if event in _SPAWN or event.startswith(("os.exec", "os.spawn")):
        RAN.append(event)
    # Imports exec code from real files; eval/exec of a payload's string compiles "<string>".
    if event == "compile" and args[1] in (None, "<string>", b"<string>"):
        RAN.append(event)
    if event == "exec" and getattr(args[0], "co_filename", "") == "<string>":
        RAN.append(event)


sys.addaudithook(_audit)  # process-wide and permanent (Python offers no removal): gated


@contextmanager
def watching(marker: Path) -> Iterator[None]:
    """Asserts that nothing ran: no process, no eval/exec, no marker file, no global set."""
    RAN.clear()
    WATCHING[0] = True
    try:
        yield
    finally:
        WATCHING[0] = False
    assert RAN == [] and not marker.exists() and not hasattr(builtins, FLAG), RAN


# -- hostile pickles, built opcode by opcode ---------------------------------------------


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str, how: str) -> bytes:
    if how == "GLOBAL":
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _call(module: str, name: str, arg: str, how: str, form: str) -> bytes:
    """A pickle fragment that calls ``module.name(arg)`` when loaded (if allowed)."""
    if form == "INST":
        return b"(" + _str(arg) + b"i" + module.encode() + b"\n" + name.encode() + b"\n"
    if form == "OBJ":
        return b"(" + _global(module, name, how) + _str(arg) + b"o"
    if form == "NEWOBJ":
        return _global(module, name, how) + _str(arg) + b"\x85\x81"
    if form == "BUILD":  # setstate on whatever the global is: rebinds e.g. os.system
        return _global(module, name, how) + b"}" + _str("system") + _str(arg) + b"sb"
    return _global(module, name, how) + _str(arg) + b"\x85R"  # REDUCE


def _payload(marker: Path) -> dict[tuple[str, str], str]:
    touch = f"touch {marker}"
    code = f"__import__('builtins').{FLAG} = True; open({str(marker)!r}, 'w').close()"
    return {
        ("os", "system"): touch,
        ("posix", "system"): touch,
        ("subprocess", "getoutput"): touch,
        ("subprocess", "Popen"): touch,
        ("builtins", "eval"): code,
        ("builtins", "exec"): code,
        ("builtins", "getattr"): "system",
        ("builtins", "__import__"): "os",
        ("builtins", "open"): str(marker),
        ("io", "open"): str(marker),
        (DCP, "os.system"): touch,
        (DCP, "os"): touch,
        (DCP, "torch.load"): str(marker),
        (DCP, "dataclass"): code,
        (DCP, "field"): code,
        (DCP, "Metadata.__init__.__globals__"): code,
        ("dataclasses", "sys.modules"): code,
        ("torch.serialization", "os.system"): touch,
        ("torch", "load"): str(marker),
        ("torch", "_C._get_tracing_state"): code,
        ("torch.distributed.checkpoint.filesystem", "os.system"): touch,
        ("torch.distributed.checkpoint.filesystem", "pickle.loads"): code,
        ("collections", "os.system"): touch,
        ("pathlib", "os.system"): touch,
        ("copyreg", "_reconstructor"): code,
        ("__builtin__", "eval"): code,
    }


GENUINE = pickle.dumps(dcp.metadata.Metadata(state_dict_metadata={}, storage_data={}))


def _frame(body: bytes, protocol: int) -> bytes:
    head = b"\x80" + bytes([protocol]) if protocol >= 2 else b""
    return head + body + b"."


@st.composite
def hostile(draw: st.DrawFn, marker: Path) -> bytes:
    targets = _payload(marker)
    module, name = draw(st.sampled_from(sorted(targets)))
    protocol = draw(st.integers(0, 5))
    how = draw(st.sampled_from(["GLOBAL", "STACK_GLOBAL"]))
    form = draw(st.sampled_from(["REDUCE", "INST", "OBJ", "NEWOBJ", "BUILD"]))
    evil = _frame(_call(module, name, targets[module, name], how, form), protocol)
    placement = draw(st.sampled_from(["alone", "before genuine", "after genuine", "inside"]))
    if placement == "before genuine":
        return evil + GENUINE
    if placement == "after genuine":
        return GENUINE + evil
    if placement == "inside":  # evaluated, then popped: the genuine object is what remains
        return GENUINE[:-1] + _call(module, name, targets[module, name], how, form) + b"0."
    return evil


MARKER = Path(f"/tmp/tierstore-pwned-{os.getpid()}")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(hostile(MARKER))
def test_fuzz_hostile_metadata_runs_nothing(data: bytes) -> None:
    with watching(MARKER), pytest.raises(pickle.UnpicklingError):
        load_metadata(data)


@pytest.mark.parametrize("protocol", range(6))
def test_reduce_of_every_protocol_is_refused(protocol: int, tmp_path: Path) -> None:
    marker = tmp_path / "owned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    with watching(marker), pytest.raises(pickle.UnpicklingError, match="not allowed"):
        load_metadata(pickle.dumps(Evil(), protocol=protocol))


def test_genuine_then_junk_is_refused() -> None:
    meta = dcp.metadata.Metadata(state_dict_metadata={}, storage_data={})
    for protocol in range(2, 6):
        data = pickle.dumps(meta, protocol=protocol)
        assert isinstance(load_metadata(data), dcp.metadata.Metadata)
        with pytest.raises(pickle.UnpicklingError, match="follow the pickle"):
            load_metadata(data + b"\x00")


def test_old_allow_the_whole_module_rule_is_caught(monkeypatch, tmp_path: Path) -> None:
    # Bug put back: the old rule allowed every name of the DCP metadata module, and pickle
    # protocol 4 resolves "os.system" through it. The same payload the fuzz test feeds must
    # then run, or the fuzz test could not catch the bug.
    marker = tmp_path / "owned"

    def old_rule(self, module: str, name: str):  # type: ignore[no-untyped-def]
        if module == DCP:
            return pickle.Unpickler.find_class(self, module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")

    monkeypatch.setattr(_safe_pickle._MetadataUnpickler, "find_class", old_rule)
    evil = _frame(_call(DCP, "os.system", f"touch {marker}", "STACK_GLOBAL", "REDUCE"), 4)
    with pytest.raises(pickle.UnpicklingError):  # it ran, then "0 is not a Metadata object"
        load_metadata(evil)
    assert marker.exists()


# -- through TieredReader: hot tier and a bucket-like cold tier ---------------------------


def _state() -> dict:
    return {"w": torch.randn(8, 3), "extra": {"step": 7, "tags": ["a", "b"], "lr": 0.5}}


def _blank() -> dict:
    return {"w": torch.zeros(8, 3), "extra": {"step": 0, "tags": [], "lr": 0.0}}


def _reseal(root: Path, name: str, files: dict[str, bytes]) -> None:
    """Replace files of a checkpoint and fix up its manifest, as a forger would."""
    mpath = root / layout.manifest_key(name)
    body = json.loads(mpath.read_text())
    for entry in body["files"]:
        if entry["path"] in files:
            data = files[entry["path"]]
            (root / layout.file_key(name, body["attempt"], entry["path"])).write_bytes(data)
            entry.update(size=len(data), crc32c=crc32c_update(0, data))
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    mpath.write_text(json.dumps(body))


def _load_error(root: Path, role: str) -> BaseException:
    reader = TieredReader(str(root)) if role == "hot" else TieredReader(None, str(root))
    with pytest.raises(BaseException) as info:
        dcp.load(_blank(), storage_reader=reader)
    return unwrap(info.value)


@pytest.mark.parametrize("role", ["hot", "cold"])
@pytest.mark.parametrize(
    "target",
    [
        ("os", "system"),
        (DCP, "os.system"),
        ("builtins", "exec"),
        ("dataclasses", "sys.modules"),
        (DCP, "dataclass"),
    ],
)
def test_hostile_metadata_through_reader(tmp_path: Path, role: str, target: tuple[str, str]) -> None:
    root, marker = tmp_path / role, tmp_path / "owned"
    dcp.save(_state(), storage_writer=TieredWriter(str(root), step=1))
    arg = _payload(marker)[target]
    _reseal(
        root,
        layout.default_name(1),
        {".metadata": _frame(_call(*target, arg, "STACK_GLOBAL", "REDUCE"), 4) + GENUINE},
    )
    with watching(marker):
        err = _load_error(root, role)
    assert isinstance(err, IntegrityError) and "cannot be loaded safely" in str(err), err
    assert err.file == ".metadata" and err.checkpoint == layout.default_name(1)
    assert err.tier == f"{role} {root}"


@pytest.mark.parametrize("encoding", ["raw", "dcp"])
def test_hostile_byte_io_item_runs_nothing(tmp_path: Path, encoding: str) -> None:
    # DCP's DefaultLoadPlanner torch.loads BYTE_IO items with weights_only=False: a forged
    # item must be refused before the planner sees it.
    root, marker = tmp_path / "hot", tmp_path / "owned"
    dcp.save(
        _state(), storage_writer=TieredWriter(str(root), step=1, options=WriterOptions(encoding=encoding))
    )
    name = layout.default_name(1)
    attempt = json.loads((root / layout.manifest_key(name)).read_text())["attempt"]

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    meta = pickle.loads((root / layout.file_key(name, attempt, ".metadata")).read_bytes())
    index = next(i for i in meta.storage_data if i.fqn == "extra.step")
    info = meta.storage_data[index]
    shard = (root / layout.file_key(name, attempt, info.relative_path)).read_bytes()
    # A raw item's forger also fixes up its block checksum.
    sealed = {"crc32c": (crc32c_update(0, buf.getvalue()),)} if encoding == "raw" else {}
    meta.storage_data[index] = dataclasses.replace(
        info, offset=len(shard), length=len(buf.getvalue()), **sealed
    )
    _reseal(root, name, {info.relative_path: shard + buf.getvalue(), ".metadata": pickle.dumps(meta)})
    with watching(marker):
        err = _load_error(root, "hot")
    assert isinstance(err, IntegrityError) and "'extra.step' cannot be loaded safely" in str(err)
    assert err.file == info.relative_path and err.checkpoint == name and err.tier == f"hot {root}"


# -- genuine metadata still loads ---------------------------------------------------------


def _dtypes() -> list[torch.dtype]:
    skip = (
        "bits",
        "qint",
        "quint",
        "int1",
        "int2",
        "int3",
        "int4",
        "int5",
        "int6",
        "int7",
        "uint1",
        "uint2",
        "uint3",
        "uint4",
        "uint5",
        "uint6",
        "uint7",
    )
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted((d for d in found if not str(d).removeprefix("torch.").startswith(skip)), key=str)


def test_every_dtype_nested_containers_and_byte_io_round_trip(tmp_path: Path) -> None:
    state: dict = {str(d): torch.zeros(4, dtype=d) for d in _dtypes()}
    state["nested"] = {
        "a": [torch.arange(6.0).reshape(2, 3), {"b": torch.ones(2, 2)}],
        "c": 5,
        "d": "text",
        "e": [1.5, None, (1, 2)],
        "f": {"g": b"raw", "h": {3, 4}},
    }
    state["channels_last"] = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    dcp.save(state, storage_writer=TieredWriter(str(tmp_path), step=1))
    target: dict = {
        k: torch.full_like(v.view(torch.uint8), 0xFF).view(v.dtype)
        for k, v in state.items()
        if k.startswith("torch.")
    }
    target["channels_last"] = torch.zeros(2, 3, 4, 5)
    target["nested"] = {
        "a": [torch.zeros(2, 3), {"b": torch.zeros(2, 2)}],
        "c": 0,
        "d": "",
        "e": [],
        "f": {"g": b"", "h": set()},
    }
    reader = TieredReader(str(tmp_path))
    dcp.load(target, storage_reader=reader)
    assert target["nested"]["c"] == 5 and target["nested"]["f"] == {"g": b"raw", "h": {3, 4}}
    assert target["nested"]["e"] == [1.5, None, (1, 2)]
    assert torch.equal(target["nested"]["a"][0], state["nested"]["a"][0])
    assert torch.equal(target["channels_last"], state["channels_last"])
    for d in _dtypes():
        assert target[str(d)].dtype == d and target[str(d)].view(torch.uint8).eq(0).all(), d


FSDP_JOB = textwrap.dedent("""
    import os, sys, pickle, io
    import torch, torch.nn as nn, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from tierstore import TieredReader, TieredWriter
    from tierstore.format import layout
    from tierstore.format.safe_pickle import ALLOWED, load_metadata
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        for b in m: fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)
    m, opt = build(0)
    m(torch.randn(3, 4)).sum().backward(); opt.step()
    msd, osd = get_state_dict(m, opt)
    root = sys.argv[1]
    dcp.save({"model": msd, "optim": osd, "extra": {"step": 3, "rng": torch.get_rng_state()}},
             storage_writer=TieredWriter(root, step=3))
    seen = set()
    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name)); return super().find_class(module, name)
    import glob
    data = open(glob.glob(root + "/**/.metadata", recursive=True)[0], "rb").read()
    Recorder(io.BytesIO(data)).load()
    load_metadata(data)
    m2, opt2 = build(1)
    m2(torch.randn(3, 4)).sum().backward(); opt2.step()
    msd2, osd2 = get_state_dict(m2, opt2)
    state = {"model": msd2, "optim": osd2, "extra": {"step": 0, "rng": torch.zeros_like(torch.get_rng_state())}}
    dcp.load(state, storage_reader=TieredReader(root))
    set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    a, b = get_state_dict(m, opt), get_state_dict(m2, opt2)
    same = all(torch.equal(x.full_tensor(), a[0][k].full_tensor()) for k, x in b[0].items())
    assert same and state["extra"]["step"] == 3, "state differs after load"
    for fqn, per_param in b[1]["state"].items():
        for key, value in per_param.items():
            want = a[1]["state"][fqn][key]
            full = getattr(value, "full_tensor", lambda: value)
            assert torch.equal(full(), getattr(want, "full_tensor", lambda: want)()), (fqn, key)
    print("GLOBALS", sorted(g for g in seen if g[0] != "torch"))
    dist.destroy_process_group()
""")


def test_fsdp2_dtensor_with_optimizer_round_trips(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", FSDP_JOB, str(tmp_path / "hot")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("GLOBALS"))
    used = {tuple(g) for g in ast.literal_eval(line.removeprefix("GLOBALS "))}
    assert used and used <= _safe_pickle.ALLOWED, used - _safe_pickle.ALLOWED
