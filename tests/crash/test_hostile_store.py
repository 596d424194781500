"""The hostile-store fuzzer (issue 12): a small real store (hot and cold local tiers, two
checkpoints saved through DCP, the first migrated) is damaged between operations the way
a hostile or broken filesystem would, then every read and maintenance operation runs on it.

Mutations: manifests (truncated, flipped, wrong-shaped JSON, forged and re-sealed), upload
marks, leases, a hostile ``.metadata`` pickle, files and directories replaced by symbolic
links into a canary directory outside the store (a mirror of the store, so a link-following
delete or write would land on real files), and FIFOs in place of files.

Invariants after every operation:

1. no code from the store runs (an audit hook on process creation, and a sentinel file);
2. nothing outside the store roots changes (the canary mirror, and a file beside the roots);
3. no operation hangs (FIFOs!);
4. every error is a ``TierstoreError`` (DCP's ``CheckpointException`` unwrapped) naming the
   key, file or checkpoint and the tier; a load that returns has the right bytes.

Each mutation family is its own test, so a family whose bugs are still being fixed is
marked ``xfail`` by itself (``KNOWN``). The mark is strict: the family must fail while it is
listed, and once the fix lands it fails as XPASS until the lead removes the entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import model
import pytest
import torch.distributed.checkpoint as dcp
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from stats import STATS

from tierstore import Store as TierStore
from tierstore import TieredWriter, cli, list_checkpoints
from tierstore.errors import CheckpointNotFound, ObjectNotFound, PublishConflict, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import _checksum
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import keep_last
from tierstore.migration.migrator import MigrationState
from tierstore.migration.restore import restore
from tierstore.migration.status import migrate_pending, migration_status
from tierstore.storage.backend import crc32c_update
from tierstore.storage.local import LocalBackend
from tierstore.tiers import marks

PROFILE = settings.get_profile(os.environ.get("TIERSTORE_CRASH_PROFILE", "ci"))
# Families share the profile's budget in CI (about a minute in all); soak runs each in full.
SOAK = PROFILE.max_examples > 100
EXAMPLES = PROFILE.max_examples if SOAK else max(3, PROFILE.max_examples // 4)
# CI does not shrink: each failure message already names its mutations and operation.
PHASES = tuple(Phase) if SOAK else (Phase.explicit, Phase.reuse, Phase.generate)
HANG_S = 60.0  # a generous bound: these operations take well under a second each
NAMES = (layout.default_name(1), layout.default_name(2))  # step 1 is migrated, step 2 pending

# -- invariant 1: no code runs ---------------------------------------------------------------

SPAWNED: list[str] = []
AUDITING = [False]
_SPAWN_EVENTS = {
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "subprocess.Popen",
    "pty.spawn",
}


def _audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    if AUDITING[0] and event in _SPAWN_EVENTS:
        SPAWNED.append(f"{event} {args!r}"[:200])


sys.addaudithook(_audit)  # process-wide and permanent (Python offers no removal): gated


# -- the store -------------------------------------------------------------------------------


@dataclass
class Store:
    base: Path  # holds the roots, the canary mirror and the canary file, nothing else

    @property
    def hot(self) -> Path:
        return self.base / "hot"

    @property
    def cold(self) -> Path:
        return self.base / "cold"

    @property
    def restored(self) -> Path:
        return self.base / "restored"  # restore's target hot tier

    @property
    def canary(self) -> Path:
        return self.base / "canary"

    @property
    def sentinel(self) -> Path:
        return self.base / "owned"

    def root(self, tier: str) -> Path:
        return self.hot if tier == "hot" else self.cold

    def manifest(self, tier: str, name: str) -> Path:
        return self.root(tier) / layout.manifest_key(name)

    def attempt(self, tier: str, name: str) -> str:
        return str(json.loads((self.base / "template" / f"{tier}-{name}").read_text()))

    def attempt_dir(self, tier: str, name: str) -> Path:
        return self.root(tier) / layout.attempt_prefix(name, self.attempt(tier, name))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hostile-template")
    hot, cold = base / "hot", base / "cold"
    for step in (1, 2):
        dcp.save(model.state_for(step), storage_writer=TieredWriter(str(hot), step=step))
    migrate_pending(TierStore.of(str(hot), str(cold)), names=[NAMES[0]], config=model.FAST)
    (base / "template").mkdir()
    for tier, root in (("hot", hot), ("cold", cold)):
        for name in NAMES:
            path = root / layout.manifest_key(name)
            if path.exists():
                attempt = json.loads(path.read_text())["attempt"]
                (base / "template" / f"{tier}-{name}").write_text(json.dumps(attempt))
    # The canary: a mirror of both tiers outside them, so a link into it names real files.
    shutil.copytree(hot, base / "canary" / "hot")
    shutil.copytree(cold, base / "canary" / "cold")
    (base / "canary.txt").write_text("beside the store roots")
    return base


@contextlib.contextmanager
def fresh_store(template: Path) -> Iterator[Store]:
    base = Path(tempfile.mkdtemp(prefix="hostile-", dir=template.parent))
    try:
        shutil.copytree(template, base, symlinks=True, dirs_exist_ok=True)
        yield Store(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def outside_snapshot(store: Store) -> dict[str, tuple[Any, ...]]:
    """Names, kinds, sizes, mtimes and content hashes of everything that is not a root."""
    found: dict[str, tuple[Any, ...]] = {}
    paths = [store.base / "canary.txt", *sorted(store.canary.rglob("*"))]
    for path in paths:
        st_ = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        found[str(path.relative_to(store.base))] = (st_.st_mode, st_.st_size, st_.st_mtime_ns, digest)
    return found


# -- mutations -------------------------------------------------------------------------------

Mutation = Callable[[Store, st.DataObject], str]
DEEP = "[" * 50_000 + "]" * 50_000  # valid JSON that json.loads cannot parse (RecursionError)
TIERS = st.sampled_from(["hot", "cold"])


def _existing(store: Store, data: st.DataObject, paths: list[Path]) -> Path | None:
    paths = [p for p in paths if os.path.lexists(p)]
    return data.draw(st.sampled_from(paths)) if paths else None


def reseal(path: Path, body: dict[str, Any]) -> None:
    body.pop("checksum", None)
    body["checksum"] = _checksum(body)
    path.unlink()
    path.write_text(json.dumps(body))


def damage_manifest(store: Store, data: st.DataObject) -> str:
    tier, name = data.draw(TIERS), data.draw(st.sampled_from(NAMES))
    path = store.manifest(tier, name)
    if not path.exists():
        return "nothing"
    raw = path.read_bytes()
    how = data.draw(st.sampled_from(["truncate", "flip", "wrong-fields", "deep", "empty"]))
    if not raw and how in ("truncate", "flip"):
        how = "empty"  # an earlier mutation of this example emptied it: nothing to cut or flip
    if how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    elif how == "wrong-fields":
        try:  # an earlier mutation of this example may have left no JSON object to start from
            body = json.loads(raw)
            body = body if isinstance(body, dict) else {}
        except (ValueError, RecursionError):
            body = {}
        raw = json.dumps(
            data.draw(
                st.sampled_from(
                    [
                        [],
                        "x",
                        None,
                        {"files": "x"},
                        {"format": 7},
                        {**body, "files": [1, 2]},
                        {**body, "step": "one"},
                        {**body, "world_size": None},
                    ]
                )
            )
        ).encode()
    elif how == "deep":
        raw = DEEP.encode()
    else:
        raw = b""
    path.unlink()
    path.write_bytes(raw)
    return f"manifest {tier}/{name}: {how}"


def forge_manifest(store: Store, data: st.DataObject) -> str:
    tier, name = data.draw(TIERS), data.draw(st.sampled_from(NAMES))
    path = store.manifest(tier, name)
    if not path.exists():
        return "nothing"
    body = json.loads(path.read_text())
    other = store.attempt("hot", NAMES[1 - NAMES.index(name)])
    how = data.draw(
        st.sampled_from(
            ["dotdot", "absolute", "other-attempt", "other-name", "bad-attempt", "huge", "foreign-file"]
        )
    )
    if how == "dotdot":
        body["files"][0]["path"] = "../" * data.draw(st.integers(1, 6)) + "canary.txt"
    elif how == "absolute":
        body["files"][0]["path"] = str(store.base / "canary.txt")
    elif how == "other-attempt":
        body["attempt"] = other
    elif how == "other-name":
        body["name"] = NAMES[1 - NAMES.index(name)]
    elif how == "bad-attempt":
        body["attempt"] = data.draw(st.sampled_from(["../../canary", "x", "", "a/b"]))
    elif how == "huge":
        body["files"][0]["size"] = data.draw(st.sampled_from([1 << 40, (1 << 50) + 1, -1]))
    else:
        body["files"].append(
            {
                "path": "victim.bin",
                "size": 22,
                "crc32c": crc32c_update(0, b"beside the store roots"),
                "rank": 0,
            }
        )
    reseal(path, body)
    return f"forged manifest {tier}/{name}: {how}"


def damage_upload_mark(store: Store, data: st.DataObject) -> str:
    name = data.draw(st.sampled_from(NAMES))
    rank = data.draw(st.integers(0, 1))
    path = store.cold / layout.upload_mark_key(name, store.attempt("hot", name), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    how = data.draw(st.sampled_from(["truncated", "wrong-rank", "huge", "non-json", "wrong-types", "deep"]))
    if how == "huge":
        with open(path, "wb") as f:
            f.truncate(70 << 20)  # sparse: larger than any honest mark
        return f"upload mark {name} rank {rank}: huge"
    body = {
        "truncated": '{"rank": 0, "files": [{"path": "__0_0.d',
        "wrong-rank": json.dumps({"rank": rank + 5, "files": []}),
        "non-json": "\x00\xff not json",
        "wrong-types": json.dumps({"rank": "0", "files": [{"path": 1, "size": "x"}]}),
        "deep": DEEP,
    }[how]
    path.write_text(body, errors="surrogateescape")
    return f"upload mark {name} rank {rank}: {how}"


def damage_lease(store: Store, data: st.DataObject) -> str:
    tier, name = data.draw(TIERS), data.draw(st.sampled_from(NAMES))
    path = store.root(tier) / layout.lease_key(name, "f" * 32)
    path.parent.mkdir(parents=True, exist_ok=True)
    how = data.draw(
        st.sampled_from(
            ["truncated", "oversize", "non-json", "future", "past", "nan", "string", "list", "deep"]
        )
    )
    body = {
        "truncated": '{"expires": 17',
        "oversize": json.dumps({"expires": 1.0, "pad": "x" * (100 << 10)}),
        "non-json": "\x00 lease",
        "future": json.dumps({"expires": 1e308}),
        "past": json.dumps({"expires": -1e308}),
        "nan": '{"expires": NaN}',
        "string": json.dumps({"expires": "tomorrow"}),
        "list": json.dumps([1, 2]),
        "deep": DEEP,
    }[how]
    path.write_text(body)
    return f"lease {tier}/{name}: {how}"


def hostile_metadata(store: Store, data: st.DataObject) -> str:
    tier, name = data.draw(TIERS), data.draw(st.sampled_from(NAMES))
    manifest = store.manifest(tier, name)
    if not manifest.exists():
        return "nothing"
    command = f"touch {store.sentinel}".encode()
    evil = data.draw(
        st.sampled_from(
            [
                b"cos\nsystem\n(S'" + command + b"'\ntR.",
                b"cposix\nsystem\n(S'" + command + b"'\ntR.",
                b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c"
                + bytes([len(command)])
                + command
                + b"\x85R.",
            ]
        )
    )
    meta = store.attempt_dir(tier, name) / layout.METADATA_FILE
    meta.unlink()
    meta.write_bytes(evil)
    body = json.loads(manifest.read_text())
    for entry in body["files"]:
        if entry["path"] == layout.METADATA_FILE:
            entry.update(size=len(evil), crc32c=crc32c_update(0, evil))
    reseal(manifest, body)
    return f"hostile .metadata {tier}/{name}"


def _files(store: Store) -> list[Path]:
    return sorted(
        p for root in (store.hot, store.cold) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
    )


def _dirs(store: Store) -> list[Path]:
    return sorted(
        p for root in (store.hot, store.cold) for p in root.rglob("*") if p.is_dir() and not p.is_symlink()
    )


def _mirror(store: Store, path: Path) -> Path:
    """The canary twin of ``path`` (same tier, same relative path) or its nearest parent."""
    tier = "hot" if path.is_relative_to(store.hot) else "cold"
    twin = store.canary / tier / path.relative_to(store.root(tier))
    while not twin.exists():
        twin = twin.parent
    return twin


def file_to_symlink(store: Store, data: st.DataObject) -> str:
    path = _existing(store, data, _files(store))
    if path is None:
        return "nothing"
    path.unlink()
    os.symlink(_mirror(store, path), path)
    return f"symlink file {path.relative_to(store.base)}"


def dir_to_symlink(store: Store, data: st.DataObject) -> str:
    tops = [
        store.root(t) / d
        for t in ("hot", "cold")
        for d in (layout.LEASE_DIR, layout.UPLOAD_DIR, layout.MIGRATED_DIR)
    ]
    path = _existing(store, data, _dirs(store) + [p for p in tops if not p.exists()])
    if path is None:
        return "nothing"
    if path.exists():
        shutil.rmtree(path)
    os.symlink(_mirror(store, path), path)
    return f"symlink dir {path.relative_to(store.base)}"


def file_to_fifo(store: Store, data: st.DataObject) -> str:
    path = _existing(store, data, _files(store))
    if path is None:
        return "nothing"
    path.unlink()
    os.mkfifo(path)
    return f"fifo {path.relative_to(store.base)}"


MUTATIONS: dict[str, Mutation] = {
    "manifest-damage": damage_manifest,
    "manifest-forged": forge_manifest,
    "upload-mark": damage_upload_mark,
    "lease": damage_lease,
    "metadata-pickle": hostile_metadata,
    "symlink-file": file_to_symlink,
    "symlink-dir": dir_to_symlink,
    "fifo": file_to_fifo,
}

# -- operations ------------------------------------------------------------------------------


def op_list(s: Store) -> None:
    list_checkpoints(TierStore.of(str(s.hot), str(s.cold)))


class WrongBytes(AssertionError):
    """A load returned without error but with the wrong state: always a violation."""


def op_load(s: Store) -> None:
    state, _ = model.load(str(s.hot), str(s.cold))
    step = state["extra"]["step"]
    if step not in (1, 2) or not model.matches(state, step):
        raise WrongBytes(f"load returned wrong bytes (step {step})")


def op_prune(s: Store) -> None:
    reports = prune(TierStore.of(str(s.hot), str(s.cold)), hot_policy=keep_last(1), cold_policy=keep_last(1))
    PROBLEMS[:] = [e for r in reports for e in r.errors]


def op_gc(s: Store) -> None:
    report = collect_garbage(TierStore.of(str(s.hot), str(s.cold)), grace=0, dry_run=False)
    PROBLEMS[:] = [str(p) for p in report.failures]


# What the last prune or gc could not do (they report, never stop): harmless damage must
# leave this empty.
PROBLEMS: list[str] = []


def op_migrate(s: Store) -> None:
    migrate_pending(TierStore.of(str(s.hot), str(s.cold)), config=model.FAST)


def op_restore(s: Store) -> None:
    restore(TierStore.of(str(s.restored), str(s.cold)), config=model.FAST)


def op_status(s: Store) -> None:
    migration_status(TierStore.of(str(s.hot), str(s.cold)))


def op_verify(s: Store) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["verify", "--hot", str(s.hot), "--cold", str(s.cold)])


OPERATIONS: dict[str, Callable[[Store], None]] = {
    "list": op_list,
    "load": op_load,
    "prune": op_prune,
    "gc": op_gc,
    "migrate": op_migrate,
    "restore": op_restore,
    "status": op_status,
    "verify": op_verify,
}


def _unblock_fifos(store: Store) -> None:
    """Open every FIFO both ways, non-blocking, so an operation stuck in open() returns."""
    for root in (store.hot, store.cold, store.restored):
        for path in root.rglob("*") if root.exists() else ():
            if path.is_fifo():
                for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                    with contextlib.suppress(OSError):
                        os.close(os.open(path, flags))


def run_op(store: Store, op: str) -> BaseException | None:
    """Run one operation; return what it raised. Fails on a hang."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            OPERATIONS[op](store)
            outcome.append(None)
        except BaseException as err:  # judged by the caller
            outcome.append(err)

    worker = threading.Thread(target=target, daemon=True)
    AUDITING[0] = True
    try:
        worker.start()
        worker.join(HANG_S)
        hung = worker.is_alive()
        while worker.is_alive():
            _unblock_fifos(store)
            worker.join(1.0)
    finally:
        AUDITING[0] = False
    assert not hung, f"{op} hung"
    return outcome[0]


def check_error(op: str, raised: BaseException | None) -> None:
    if raised is None:
        return
    err = model.unwrap(raised)
    if isinstance(err, WrongBytes):
        raise err
    assert isinstance(err, TierstoreError), f"{op} raised {type(err).__name__}: {str(err)[:300]}"
    named = err.key or err.file or err.checkpoint or isinstance(err, CheckpointNotFound)
    assert named and err.tier, f"{op}: {type(err).__name__} names no key/file or tier: {err}"


def check_unharmed(store: Store, op: str, raised: BaseException | None) -> None:
    """Damaged leases and upload marks are only ever ignored (honoured for a TTL, or the
    rank uploaded again): every operation still succeeds and a migration still commits."""
    assert raised is None, f"{op} failed: {type(model.unwrap(raised)).__name__}: {model.unwrap(raised)}"
    if op in ("prune", "gc"):
        assert PROBLEMS == [], f"{op} could not finish: {PROBLEMS[:3]}"
    if op == "migrate":
        states = {s.name: s.state for s in migration_status(TierStore.of(str(store.hot), str(store.cold)))}
        assert set(states.values()) == {MigrationState.COMMITTED}, f"migration wedged: {states}"


def check_outside(store: Store, before: dict[str, tuple[Any, ...]], what: str) -> None:
    after = outside_snapshot(store)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], f"{what} changed what is outside the store: {changed[:5]}"


def exercise(store: Store, mutations: list[str], ops: list[str], *, harmless: bool = False) -> None:
    """Run ``ops`` on the mutated store, checking every invariant after each (and, for
    ``harmless`` damage, that nothing fails at all)."""
    before = outside_snapshot(store)
    SPAWNED.clear()
    for op in ops:
        what = f"{op} after {mutations}"
        PROBLEMS.clear()
        raised = run_op(store, op)
        STATS.steps += 1
        assert SPAWNED == [] and not store.sentinel.exists(), f"{what} ran code: {SPAWNED}"
        check_outside(store, before, what)
        try:
            check_error(op, raised)
            if harmless:
                check_unharmed(store, op, raised)
        except AssertionError as failure:
            raise AssertionError(f"{failure} (after {mutations})") from raised


# Damage a reader or migrator must shrug off: the data and manifests are all intact.
HARMLESS = {"lease", "upload-mark"}
OPS = st.permutations(sorted(OPERATIONS))  # every operation, in a drawn order

# Families with bugs other engineers are fixing (issue 12): remove an entry when its fix
# lands (a strict xfail that passes fails). Each reason is the minimal failing example the
# fuzzer found.
KNOWN: dict[str, str] = {}  # family -> reason, while a bug this fuzzer found is being fixed


def _family(name: str) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[name])] if name in KNOWN else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("family", [_family(name) for name in MUTATIONS])
def test_hostile_store(template: Path, family: str) -> None:
    @settings(PROFILE, max_examples=EXAMPLES, database=None, phases=PHASES, print_blob=False)
    @given(data=st.data(), ops=OPS)
    def run(data: st.DataObject, ops: list[str]) -> None:
        with fresh_store(template) as store:
            count = data.draw(st.integers(1, 2), label="mutations")
            done = [MUTATIONS[family](store, data) for _ in range(count)]
            STATS.examples += 1
            STATS.faults += count
            exercise(store, done, ops, harmless=family in HARMLESS)

    run()


# -- the suite can fail: put the symlink-following delete back -------------------------------


def naive_delete(self: LocalBackend, key: str) -> None:
    """The old LocalBackend.delete: a plain unlink by path, following links on the way."""
    path = os.path.join(self.root, *key.split("/"))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def test_fuzzer_catches_a_delete_that_follows_symlinks(
    template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LocalBackend, "delete", naive_delete)
    with fresh_store(template) as store:
        attempt = store.attempt_dir("hot", NAMES[0])  # migrated, so prune may drop it
        shutil.rmtree(attempt)
        os.symlink(_mirror(store, attempt), attempt)
        with pytest.raises(AssertionError, match="changed what is outside the store"):
            exercise(store, ["symlink dir hot attempt of step 1"], ["prune"])
        assert not (_mirror(store, attempt) / layout.METADATA_FILE).exists()  # really deleted
    STATS.faults += 1
    STATS.violations = max(0, STATS.violations)  # an expected catch, not a product violation


# -- the suite can fail: put the wedging mark and lease handling back (issue 12, item 4) -----


def old_publish_upload_mark(tier: Any, name: str, attempt: str, rank: int, files: Any) -> None:
    """The old mark publish: a mark already there with other bytes was a conflict, forever."""
    key = layout.upload_mark_key(name, attempt, rank)
    body = marks._mark_body(rank, marks._sorted(files))
    try:
        tier.backend.publish(key, body)
    except PublishConflict:
        if tier.backend.read_bytes(key) != body:
            raise


def old_live_leases(tier: Any, name: str, **_: Any) -> list[str]:
    """The old lease check: one oversize lease raised out of prune and gc."""
    live = []
    for info in tier.backend.list(layout.lease_prefix(name)):
        try:
            body = json.loads(tier.backend.read_bytes(info.key, limit=1 << 16))
            expires = float(body["expires"])
        except ObjectNotFound:
            continue
        except (ValueError, KeyError, TypeError):
            expires = (info.mtime or time.time()) + 6 * 3600
        if expires > time.time():
            live.append(info.key)
    return live


def test_fuzzer_catches_a_damaged_mark_that_wedges_migration(
    template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(marks, "publish_upload_mark", old_publish_upload_mark)
    with fresh_store(template) as store:
        pending = NAMES[1]
        path = store.cold / layout.upload_mark_key(pending, store.attempt("hot", pending), 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"rank": 0, "files": [{"path": "__0_0.d')
        with pytest.raises(AssertionError, match="migration wedged"):
            exercise(store, ["upload mark truncated"], ["migrate"], harmless=True)
    STATS.faults += 1


def test_fuzzer_catches_an_oversize_lease_that_stops_pruning(
    template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``tierstore.lifecycle.prune`` the attribute is the function; the module is in sys.modules.
    monkeypatch.setattr(sys.modules["tierstore.lifecycle.prune"], "live_leases", old_live_leases)
    with fresh_store(template) as store:
        path = store.hot / layout.lease_key(NAMES[0], "f" * 32)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"expires": 1.0, "pad": "x" * (100 << 10)}))
        with pytest.raises(AssertionError, match="prune (failed|could not finish)"):
            exercise(store, ["lease oversize"], ["prune"], harmless=True)
    STATS.faults += 1
