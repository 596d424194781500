"""The backend and cold-tier contracts as reusable pytest suites.

Every backend, built-in or plugin, proves the guarantees of :mod:`tierstore.storage.backend` by
subclassing :class:`BackendContract` and providing a fresh, empty backend::

    from tierstore.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            return MyBackend(f"my://{tmp_path}")

Class attributes tune it: ``large_size`` (bytes streamed by the large-file tests),
``stream_memory_limit`` (the most Python-heap growth allowed while streaming it) and
``versions`` (``True``: the backend must report object versions; a backend that reports
none is still correct, only slower to commit to, and the version tests then only check
that it says so consistently).

A cold-tier backend also proves that a cold tier which is down never blocks or breaks a save
by subclassing :class:`ColdTierContract` and providing its tier behind a fault proxy, a
:class:`ProxiedCold`::

    from tierstore.testing import ColdTierContract, ProxiedCold

    class MyProxiedCold(ProxiedCold):
        ...  # url, set_mode, options, requests, throttle_uploads, close

    class TestMyColdDown(ColdTierContract):
        @pytest.fixture
        def proxied_cold(self, tmp_path):
            cold = MyProxiedCold(str(tmp_path / "hot"), ...)
            yield cold
            cold.close()
"""

from __future__ import annotations

import array
import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore.dcp.reader import TieredReader
from tierstore.dcp.writer import TieredWriter
from tierstore.errors import ObjectNotFound, PublishConflict, StorageError, UnsafePath
from tierstore.format import layout
from tierstore.manager import CheckpointManager
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import Backend, crc32c_update
from tierstore.tiers import migrator as migrator_module
from tierstore.tiers.catalog import list_checkpoints
from tierstore.tiers.jobs import Job, JobFailed, MigrationConfig, MigrationState
from tierstore.tiers.migrator import Migrator
from tierstore.tiers.status import migrate_pending
from tierstore.tiers.tier import Tier
from tierstore.tiers.workers import active_migrators

__all__ = [
    "BackendContract",
    "ColdTierContract",
    "ProxiedCold",
    "COLD_MODES",
    "in_background",
    "returns_within",
]

T = TypeVar("T")


def _payload(size: int, seed: int = 0) -> bytes:
    return (bytes([seed % 251]) + os.urandom(64)) * (size // 65) + os.urandom(size % 65)


class BackendContract:
    """Contract tests every backend must pass (see the module docstring)."""

    large_size = 48 << 20
    stream_memory_limit = 24 << 20
    racers = 8
    versions = False

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("subclasses provide a fresh, empty backend")

    # -- writes, reads, checksums ---------------------------------------------------------

    def test_write_then_read_back(self, backend: Backend) -> None:
        data = _payload(300_000)
        with backend.open_write("ckpt/a/file.bin") as out:
            for start in range(0, len(data), 70_000):
                out.write(memoryview(data)[start : start + 70_000])
        assert out.size == len(data)
        assert out.crc32c == crc32c_update(0, data)
        with backend.open_read("ckpt/a/file.bin") as stream:
            assert stream.read() == data
        assert backend.stat("ckpt/a/file.bin").size == len(data)

    def test_stored_crc32c_matches_bytes(self, backend: Backend) -> None:
        data = _payload(100_001, seed=3)
        with backend.open_write("c/x") as out:
            out.write(data)
        info = backend.stat("c/x")
        with backend.open_read("c/x") as stream:
            stored = stream.read()
        assert crc32c_update(0, stored) == out.crc32c == crc32c_update(0, data)
        if info.crc32c is not None:  # backends that keep a server-side checksum
            assert info.crc32c == out.crc32c

    def test_empty_object(self, backend: Backend) -> None:
        with backend.open_write("e/empty") as out:
            pass
        assert out.size == 0 and out.crc32c == 0
        assert backend.read_bytes("e/empty") == b""

    def test_abort_leaves_nothing(self, backend: Backend) -> None:
        with pytest.raises(RuntimeError):
            with backend.open_write("ab/file") as out:
                out.write(b"partial data")
                raise RuntimeError("writer died")
        assert not backend.exists("ab/file")

    def test_aborted_write_keeps_the_existing_object(self, backend: Backend) -> None:
        backend.publish("ab/kept", b"verified copy")
        with pytest.raises(RuntimeError):
            with backend.open_write("ab/kept") as out:
                out.write(_payload(200_000, seed=5))
                raise RuntimeError("writer died")
        assert backend.read_bytes("ab/kept") == b"verified copy"
        assert [i.key for i in backend.list("ab/")] == ["ab/kept"]

    def test_write_over_existing_key_replaces_it_whole_on_close(self, backend: Backend) -> None:
        old, new = _payload(150_000, seed=1), _payload(300_000, seed=2)
        with backend.open_write("ow/k") as out:
            out.write(old)
        out = backend.open_write("ow/k")
        for start in range(0, len(new), 70_000):
            out.write(memoryview(new)[start : start + 70_000])
            assert backend.read_bytes("ow/k") == old  # never a partial object
        out.close()
        assert backend.read_bytes("ow/k") == new
        assert backend.stat("ow/k").size == len(new)
        assert [i.key for i in backend.list("ow/")] == ["ow/k"]

    def test_concurrent_readers_never_see_a_partial_object(self, backend: Backend) -> None:
        versions = [_payload(600_000, seed=s) for s in range(3)]
        backend.publish("cr/k", versions[0])
        done = threading.Event()
        seen: list[Any] = []

        def read() -> None:
            while not done.is_set():
                try:
                    data = backend.read_bytes("cr/k")
                except ObjectNotFound as err:  # the key always exists: read-after-write broken
                    seen.append(err)
                    continue
                except StorageError:  # the reader noticed the replace: no partial object
                    continue
                except Exception as err:  # reported below
                    seen.append(err)
                    return
                seen.append(versions.index(data) if data in versions else f"{len(data)} bytes")

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for version in versions[1:] * 2:
                with backend.open_write("cr/k") as out:
                    for start in range(0, len(version), 1 << 16):
                        out.write(memoryview(version)[start : start + (1 << 16)])
        finally:
            done.set()
            for t in readers:
                t.join()
        partial = [s for s in seen if not isinstance(s, int)]
        assert partial == [], f"{len(partial)} reads saw no whole version, e.g. {partial[:5]}"
        assert backend.read_bytes("cr/k") == versions[2]

    def test_read_after_write_is_visible_everywhere(self, backend: Backend) -> None:
        with backend.open_write("raw/one") as out:
            out.write(b"1")
        backend.publish("raw/two", b"22")
        assert backend.exists("raw/one") and backend.exists("raw/two")
        assert {i.key for i in backend.list("raw/")} == {"raw/one", "raw/two"}
        assert backend.read_bytes("raw/two") == b"22"

    def test_missing_key_is_object_not_found_naming_key_and_tier(self, backend: Backend) -> None:
        for call in (backend.stat, backend.open_read):
            with pytest.raises(ObjectNotFound) as info:
                call("no/such/key")
            assert info.value.key == "no/such/key"
            assert "no/such/key" in str(info.value) and backend.label in str(info.value)
            assert isinstance(info.value, FileNotFoundError)
        assert not backend.exists("no/such/key")

    def test_read_bytes_limit(self, backend: Backend) -> None:
        backend.publish("lim/m", b"x" * 100)
        assert backend.read_bytes("lim/m", limit=100) == b"x" * 100
        with pytest.raises(StorageError):
            backend.read_bytes("lim/m", limit=99)

    def test_write_takes_any_buffer(self, backend: Backend) -> None:
        floats = array.array("d", range(10_000))  # itemsize 8: counted and stored as bytes
        grid = memoryview(bytearray(_payload(3 * 4096, seed=7))).cast("B", (3, 4096))
        expected = floats.tobytes() + grid.tobytes() + b"tail"
        with backend.open_write("buf/any") as out:
            assert out.write(memoryview(floats)) == len(floats.tobytes())
            assert out.write(grid) == 3 * 4096
            out.write(bytearray(b"tail"))
        assert out.size == len(expected) and out.crc32c == crc32c_update(0, expected)
        assert backend.read_bytes("buf/any") == expected

    # -- deferred directory durability -----------------------------------------------------

    def test_deferred_dir_sync_write_is_readable_and_listed_once_closed(self, backend: Backend) -> None:
        data = {f"dd/r0/{i}.bin": _payload(70_000 + i, seed=i) for i in range(3)}
        for key, payload in data.items():
            with backend.open_write(key, defer_dir_sync=True) as out:
                out.write(payload)
            assert backend.read_bytes(key) == payload
        assert {i.key for i in backend.list("dd/")} == set(data)
        backend.sync_dirs(data)
        assert {k: backend.read_bytes(k) for k in data} == data

    def test_sync_dirs_takes_any_keys(self, backend: Backend) -> None:
        backend.publish("sd/written", b"x")
        backend.sync_dirs([])
        backend.sync_dirs(["sd/written", "sd/never", "never/deeper/key", "top-level-never"])
        backend.sync_dirs(iter(["sd/written/below-a-file"]))
        assert backend.read_bytes("sd/written") == b"x"

    # -- publish ------------------------------------------------------------------------

    def test_publish_is_exclusive(self, backend: Backend) -> None:
        backend.publish("m/ckpt.json", b"first")
        with pytest.raises(PublishConflict) as info:
            backend.publish("m/ckpt.json", b"second")
        assert info.value.key == "m/ckpt.json"
        assert backend.read_bytes("m/ckpt.json") == b"first"

    def test_racing_publishers_exactly_one_wins(self, backend: Backend) -> None:
        barrier = threading.Barrier(self.racers)
        outcome: dict[int, Any] = {}

        def race(i: int) -> None:
            barrier.wait()
            try:
                backend.publish("race/m.json", f"writer-{i}".encode())
                outcome[i] = "won"
            except PublishConflict:
                outcome[i] = "lost"
            except Exception as err:  # pragma: no cover - reported below
                outcome[i] = err

        threads = [threading.Thread(target=race, args=(i,)) for i in range(self.racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, r in outcome.items() if r == "won"]
        assert len(winners) == 1, outcome
        assert all(r in ("won", "lost") for r in outcome.values()), outcome
        assert backend.read_bytes("race/m.json") == f"writer-{winners[0]}".encode()

    def test_publish_leaves_no_temporaries_visible_as_the_key(self, backend: Backend) -> None:
        backend.publish("p/a.json", b"{}")
        assert [i.key for i in backend.list("p/") if i.key.endswith(".json")] == ["p/a.json"]

    # -- listing and deleting ----------------------------------------------------------

    def test_list_is_recursive_and_scoped(self, backend: Backend) -> None:
        for key in ("l/a", "l/b/c", "l/b/d/e", "other/f"):
            backend.publish(key, key.encode())
        infos = {i.key: i for i in backend.list("l/")}
        assert set(infos) == {"l/a", "l/b/c", "l/b/d/e"}
        assert infos["l/b/c"].size == len(b"l/b/c")
        assert {i.key for i in backend.list("")} >= {"l/a", "other/f"}
        assert list(backend.list("nothing-here/")) == []

    def test_delete_is_idempotent(self, backend: Backend) -> None:
        backend.publish("d/x", b"x")
        backend.delete("d/x")
        backend.delete("d/x")
        backend.delete("d/never-existed")
        assert not backend.exists("d/x")
        assert list(backend.list("d/")) == []

    def test_delete_many_removes_every_key_missing_ones_included(self, backend: Backend) -> None:
        keys = [f"dm/{i // 7}/k{i}" for i in range(23)]
        for key in keys:
            backend.publish(key, key.encode())
        backend.publish("dm-keep/x", b"x")
        backend.delete_many([*keys[:20], "dm/never-existed"])
        assert {i.key for i in backend.list("dm/")} == set(keys[20:])
        backend.delete_many(keys)  # again, every key already gone or going: no error
        backend.delete_many([])
        assert list(backend.list("dm/")) == []
        assert backend.read_bytes("dm-keep/x") == b"x"

    # -- versions and the conditional delete ---------------------------------------------

    def _versioned(self, backend: Backend) -> bool:
        """Whether ``backend`` reports versions (required where ``versions`` says so)."""
        with backend.open_write("v/probe") as out:
            out.write(b"probe")
        found = out.version is not None or backend.stat("v/probe").version is not None
        assert found or not self.versions, "this backend must report object versions"
        return found

    def test_a_write_reports_the_version_stat_and_list_show(self, backend: Backend) -> None:
        if not self._versioned(backend):
            pytest.skip("this backend reports no versions")
        with backend.open_write("v/a") as out:
            out.write(b"first bytes")
        listed = {i.key: i for i in backend.list("v/")}
        assert out.version is not None
        assert backend.stat("v/a").version == listed["v/a"].version == out.version

    def test_other_bytes_of_the_same_size_are_another_version(self, backend: Backend) -> None:
        if not self._versioned(backend):
            pytest.skip("this backend reports no versions")
        with backend.open_write("v/b") as first:
            first.write(b"A" * 4096)
        with backend.open_write("v/b") as second:
            second.write(b"B" * 4096)
        assert first.version != second.version
        assert backend.stat("v/b").version == second.version
        backend.delete("v/b")
        backend.publish("v/b", b"C" * 4096)  # a publish after a delete: another version too
        assert backend.stat("v/b").version not in (first.version, second.version)

    def test_delete_if_deletes_only_the_version_it_names(self, backend: Backend) -> None:
        if not self._versioned(backend):
            pytest.skip("this backend reports no versions")
        with backend.open_write("v/c") as old:
            old.write(b"old bytes")
        with backend.open_write("v/c") as new:
            new.write(b"new bytes")
        assert old.version is not None and new.version is not None
        assert backend.delete_if("v/c", old.version) is False  # written since: it stays
        assert backend.read_bytes("v/c") == b"new bytes"
        assert backend.delete_if("v/c", new.version) is True
        assert not backend.exists("v/c")
        assert backend.delete_if("v/c", new.version) is True  # gone already: idempotent

    def test_open_range_reads_exactly_the_range(self, backend: Backend) -> None:
        data = bytes(range(256)) * 64 + b"tail"
        with backend.open_write("rg/obj") as writer:
            writer.write(data)
        for offset, length in (
            (0, 10),
            (300, 1000),
            (len(data) - 4, 4),
            (len(data) - 2, 100),
            (len(data), 5),
        ):
            with backend.open_range("rg/obj", offset, length) as stream:
                got = stream.read()
            assert got == data[offset : offset + length], (offset, length)
        with backend.open_range("rg/obj", 1000, 3000) as stream:  # read in pieces
            pieces = [stream.read(1000) for _ in range(4)]
        assert b"".join(pieces) == data[1000:4000] and pieces[-1] == b""
        with pytest.raises(ObjectNotFound):
            backend.open_range("rg/missing", 0, 1).read()

    # -- keys --------------------------------------------------------------------------

    @pytest.mark.parametrize("key", ["../escape", "/abs/key", "a//b", "a/./b", "a/../b", "", "a\\b"])
    def test_unsafe_keys_are_rejected(self, backend: Backend, key: str) -> None:
        with pytest.raises(UnsafePath):
            backend.publish(key, b"x")
        with pytest.raises(UnsafePath):
            backend.open_read(key)

    # -- streaming ---------------------------------------------------------------------

    def test_large_file_is_streamed_both_ways(self, backend: Backend) -> None:
        chunk = os.urandom(1 << 20)
        chunks = self.large_size // len(chunk)
        expected_crc = 0
        for _ in range(chunks):
            expected_crc = crc32c_update(expected_crc, chunk)
        tracemalloc.start()
        try:
            with backend.open_write("big/file") as out:
                for _ in range(chunks):
                    out.write(chunk)
            _, write_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            crc, total = 0, 0
            with backend.open_read("big/file") as stream:
                while block := stream.read(1 << 20):
                    crc = crc32c_update(crc, block)
                    total += len(block)
            _, read_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert (total, crc) == (chunks * len(chunk), expected_crc)
        assert out.crc32c == expected_crc
        assert write_peak < self.stream_memory_limit, f"write held {write_peak} bytes"
        assert read_peak < self.stream_memory_limit, f"read held {read_peak} bytes"

    def test_repr_is_safe(self, backend: Backend) -> None:
        assert type(backend).__name__ in repr(backend)
        assert backend.scheme


def in_background(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    """``fn()`` on a daemon thread; the box gets its ``value`` or its ``error``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # DCP's CheckpointException is no Exception
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def returns_within(fn: Callable[[], T], seconds: float, what: str) -> T:
    """``fn()``, run on a thread; fails the test if it has not returned after ``seconds``
    (a call blocked on a tier that is down), else returns its value or raises its error."""
    thread, box = in_background(fn)
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{what} did not return within {seconds:.0f}s: it is blocked on the cold tier")
    if "error" in box:
        raise box["error"]
    return box.get("value")  # type: ignore[return-value]


# -- a cold tier that is down ----------------------------------------------------------------

#: What a cold tier's fault proxy does: forward, refuse connections, stall (accept, read,
#: never answer), or deny writes (the service's 403) while reads pass.
COLD_MODES = ("healthy", "refuse", "stall", "deny_writes")

_HANG = 60.0  # seconds: far beyond any hot save here; only a save blocked on the cold tier gets there
_ONE_TRY = RetryPolicy(attempts=1, deadline=5.0, initial=0.01, maximum=0.05)
_FAST_MIGRATION = MigrationConfig(retry=_ONE_TRY, commit_timeout=5.0, poll_interval=0.05)


class ProxiedCold:
    """A cold tier behind a fault proxy, for :class:`ColdTierContract`.

    ``hot`` is a fresh local directory per test (migrators are cached by hot and cold tier);
    ``url`` is the cold tier's. A backend's suite implements the rest: ``set_mode`` (one of
    :data:`COLD_MODES`), ``options`` (through the proxy, or straight to the server),
    ``requests`` (what reached the proxy), ``throttle_uploads`` and ``close``.
    """

    retry = _ONE_TRY  # the policy ``options`` should give the tier: one try, short backoffs

    def __init__(self, hot: str, url: str) -> None:
        self.hot = hot
        self.url = url

    def set_mode(self, mode: str) -> None:
        raise NotImplementedError

    def options(self, *, through_proxy: bool = True) -> dict[str, Any]:
        raise NotImplementedError

    def requests(self) -> list[Any]:
        """Every request that reached the proxy."""
        raise NotImplementedError

    def throttle_uploads(self) -> None:
        """From now on every upload request is answered with the service's throttling error."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the proxy: stalled requests are dropped, connections refused. Idempotent."""
        raise NotImplementedError

    def direct(self) -> Tier:
        return Tier("cold", self.url, self.options(through_proxy=False))

    def migrators(self) -> list[Migrator]:
        return [m for m in active_migrators() if m.hot.url == self.hot]

    def drain(self) -> None:
        for migrator in self.migrators():
            assert migrator.wait(_HANG), "the background migrator did not finish its jobs"


def _state_for(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 256, generator=gen), "b": torch.arange(step, step + 1000)}


def _blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(128, 256), "b": torch.zeros(1000, dtype=torch.int64)}


def _returns(fn: Callable[[], T], what: str) -> T:
    return returns_within(fn, _HANG, what)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _load_hot(hot: str, step: int) -> dict[str, torch.Tensor]:
    target = _blank()
    dcp_load(target, storage_reader=TieredReader(hot, step=step))
    return target


def _load_cold_alone(cold: ProxiedCold, step: int) -> dict[str, torch.Tensor]:
    target = _blank()
    reader = TieredReader(None, cold.url, step=step, cold_options=cold.options(through_proxy=False))
    dcp_load(target, storage_reader=reader)
    return target


def _assert_committed_hot(cold: ProxiedCold, steps: list[int], *, kept: list[int] | None = None) -> None:
    """``steps`` are committed on hot and load bit-exact from it; ``kept``: those that must
    still be there (hot pruning may already have removed the others, once migrated)."""
    on_hot = [c.step for c in list_checkpoints(cold.hot)]
    assert set(kept if kept is not None else steps) <= set(on_hot) <= set(steps), on_hot
    for step in on_hot:
        assert step is not None
        _assert_same(_load_hot(cold.hot, step), _state_for(step))


def _writer(cold: ProxiedCold, step: int) -> TieredWriter:
    return TieredWriter(cold.hot, cold.url, step=step, cold_options=cold.options(), migration=_FAST_MIGRATION)


class ColdTierContract:
    """A cold tier that is down never blocks or breaks a save (issue 11), and a second
    migrator never deletes what the first committed (issue 12).

    The cold tier sits behind a fault proxy in each of :data:`COLD_MODES`. In every mode a
    save (``dcp.save``, ``dcp.async_save``, a ``CheckpointManager``) commits on the hot tier
    and loads back from it bit-exact; the migration stays visibly unfinished (failed, or
    pending while stalled) where training looks; once the fault is lifted
    ``migrate_pending`` finishes it, and the checkpoint loads from the cold tier alone.
    Building a writer or a manager sends the cold tier nothing. Saves run on a thread joined
    with a generous timeout: a hang detector, not a timing assertion.

    Subclasses provide the ``proxied_cold`` fixture (a :class:`ProxiedCold`). The class
    attribute ``stall_fails_fast`` says how the tier's client meets a stall: ``True`` (the
    tier's options set short client timeouts while stalled, as the S3 suite does) and its
    requests fail, so the migration fails while the stall lasts; ``False`` (fixed socket
    timeouts, as GCS's) and they wait until the stall ends, so the migration stays pending
    and the tests lift the stall before they drain the migrator. The proxy itself is the
    backend's to test: a mode that silently forwarded would pass these tests for the wrong
    reason.
    """

    stall_fails_fast = True

    @pytest.fixture
    def proxied_cold(self) -> ProxiedCold:
        raise NotImplementedError("subclasses provide the cold tier behind a fault proxy")

    @pytest.fixture(autouse=True)
    def _settle(self, proxied_cold: ProxiedCold, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        # A failing migration must not hold the test process at exit (atexit drain).
        monkeypatch.setenv("TIERSTORE_EXIT_WAIT", "0")
        yield
        proxied_cold.close()  # drops stalled requests; from now on connections are refused
        for migrator in proxied_cold.migrators():
            migrator.wait(_HANG)

    def _waits_out_a_stall(self, mode: str) -> bool:
        return mode == "stall" and not self.stall_fails_fast

    def _assert_migration(self, cold: ProxiedCold, mode: str, steps: list[int]) -> None:
        """Healthy: migrated. Down: unfinished, visibly; then lifted, migrate_pending finishes it."""
        names = {layout.default_name(step) for step in steps}
        direct = cold.direct()
        if self._waits_out_a_stall(mode):
            # Still waiting on an answer that will not come: pending, with the lag showing.
            pending = {s.name for m in cold.migrators() for s in m.pending()}
            assert pending and pending <= names
            assert all(direct.find_manifest(name) is None for name in names)
            cold.set_mode("healthy")  # the stalled requests are dropped unanswered
        cold.drain()
        statuses = [s for m in cold.migrators() for s in m.status()]
        assert {s.name for s in statuses} == names
        if mode == "healthy":
            assert all(s.state is MigrationState.COMMITTED for s in statuses), statuses
        else:
            failed = [s for s in statuses if s.state is MigrationState.FAILED]
            assert all(s.error for s in failed), statuses
            if self._waits_out_a_stall(mode):
                # The jobs ran on once the stall was lifted: failed (the dropped request) or done.
                done = (MigrationState.FAILED, MigrationState.COMMITTED)
                assert all(s.state in done for s in statuses), statuses
            else:  # every job failed and says why
                assert len(failed) == len(statuses), statuses
                assert all(direct.find_manifest(name) is None for name in names)
            cold.set_mode("healthy")
            finished = _returns(
                lambda: migrate_pending(cold.hot, cold.url, cold_options=cold.options()), "migrate_pending"
            )
            assert sorted(s.name for s in finished) == sorted(s.name for s in failed)
            assert all(s.state is MigrationState.COMMITTED for s in finished), finished
        for step in steps:
            assert direct.find_manifest(layout.default_name(step)) is not None
            _assert_same(_load_cold_alone(cold, step), _state_for(step))

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_save_commits_on_hot_whatever_the_cold_tier_does(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        proxied_cold.set_mode(mode)
        _returns(lambda: dcp_save(_state_for(1), storage_writer=_writer(proxied_cold, 1)), "dcp.save")
        assert Tier("hot", proxied_cold.hot).find_manifest(layout.default_name(1)) is not None
        _assert_committed_hot(proxied_cold, [1])
        self._assert_migration(proxied_cold, mode, [1])

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_async_save_commits_on_hot_whatever_the_cold_tier_does(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        proxied_cold.set_mode(mode)

        def save() -> None:
            future = dcp_async_save(_state_for(2), storage_writer=_writer(proxied_cold, 2))
            assert isinstance(future, Future)  # no async_stager given: a plain future
            future.result()

        _returns(save, "dcp.async_save(...).result()")
        _assert_committed_hot(proxied_cold, [2])
        self._assert_migration(proxied_cold, mode, [2])

    @pytest.mark.parametrize("mode", COLD_MODES)
    def test_manager_saves_every_step_and_reports_the_cold_tier(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        cold = proxied_cold
        cold.set_mode(mode)
        manager = _returns(
            lambda: CheckpointManager(
                cold.hot, cold.url, save_every=1, cold_options=cold.options(), migration=_FAST_MIGRATION
            ),
            "CheckpointManager()",
        )

        def train() -> None:
            for step in (1, 2, 3):
                manager.save(step, _state_for(step))
            manager.wait(migrations=False)

        _returns(train, "CheckpointManager.save x3 + wait(migrations=False)")
        # The hot policy keeps the last 2; a checkpoint the cold tier never confirmed is kept
        # too, so with the cold tier down all three stay.
        _assert_committed_hot(cold, [1, 2, 3], kept=[2, 3] if mode == "healthy" else [1, 2, 3])
        if self._waits_out_a_stall(mode):
            health = manager.health()  # where training looks: the stall shows as lag
            assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 0, 3), health
            assert health.last_error is None, health
            assert health.migrations_pending and health.migration_lag_bytes > 0, health
        else:
            cold.drain()
            health = manager.health()  # where training looks: the failures are there, not silent
            assert (health.saves_ok, health.saves_failed, health.last_saved_step) == (3, 0, 3), health
            assert health.last_error is None and health.migrations_pending == 0, health
            if mode == "healthy":
                assert health.ok and not health.migrations_failed, health
            else:
                assert not health.ok, health
                assert sorted(s.step or 0 for s in health.migrations_failed) == [1, 2, 3], health
                assert all(s.error for s in health.migrations_failed), health
        self._assert_migration(cold, mode, [1, 2, 3])
        _returns(manager.close, "CheckpointManager.close()")

    @pytest.mark.parametrize("mode", ("stall", "refuse"))
    def test_building_writer_and_manager_never_touches_the_cold_tier(
        self, proxied_cold: ProxiedCold, mode: str
    ) -> None:
        cold = proxied_cold
        cold.set_mode(mode)
        built = _returns(lambda: _writer(cold, 1), "TieredWriter()")
        assert built.cold is not None
        _returns(
            lambda: CheckpointManager(
                cold.hot, cold.url, cold_options=cold.options(), migration=_FAST_MIGRATION
            ),
            "CheckpointManager()",
        )
        assert cold.requests() == []  # not a single request reached the cold tier

    def test_a_throttled_second_migrator_never_deletes_a_committed_object(
        self, proxied_cold: ProxiedCold, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cold = proxied_cold
        dcp_save(_state_for(1), storage_writer=TieredWriter(cold.hot, step=1))
        done = migrate_pending(
            cold.hot, cold.url, cold_options=cold.options(through_proxy=False), config=_FAST_MIGRATION
        )
        assert done[0].state is MigrationState.COMMITTED
        manifest = Tier("hot", cold.hot).find_manifest(layout.default_name(1))
        assert manifest is not None
        cold.throttle_uploads()
        second = Migrator(Tier("hot", cold.hot), Tier("cold", cold.url, cold.options()), _FAST_MIGRATION)
        try:
            for entry in manifest.files:
                job = Job(manifest.name, manifest.attempt, manifest.step, entry.rank, (entry,), 0.0)
                # A second migrator that looked before the first one wrote found no verified
                # copy. Before: each retry deleted the key first, so the committed object was gone.
                with monkeypatch.context() as patch:
                    patch.setattr(migrator_module, "verified_copy", lambda *a, **k: None)
                    with pytest.raises(JobFailed):
                        second._upload_file(job, entry, {})
        finally:
            second.close()
        _assert_same(_load_cold_alone(cold, 1), _state_for(1))
