"""The backend contract as a pytest suite: :class:`BackendContract` (see :mod:`tierstore.testing`).

Needs only the storage layer: a plugin's tests import it without torch or the rest of tierstore.

Why one module of about 430 lines: it is one test class, the contract every backend runs,
and a plugin author reads it as the list of what a backend promises; split, the promises
would be spread over files that each say a part.
"""

from __future__ import annotations

import array
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from tierstore.errors import ObjectNotFound, PublishConflict, StorageError, TransientStorageError, UnsafePath
from tierstore.storage.backend import Backend, crc32c_update

__all__ = ["BackendContract", "in_background", "returns_within"]

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

    def test_report_stored_counts_every_byte_once_never_ahead_of_the_writes(self, backend: Backend) -> None:
        data = _payload(self.large_size // 4, seed=7)
        counts: list[int] = []
        with backend.open_write("rep/obj") as out:
            out.report_stored(counts.append)
            for start in range(0, len(data), 1 << 20):
                out.write(memoryview(data)[start : start + (1 << 20)])
                assert sum(counts) <= out.size
        assert sum(counts) == out.stored == len(data) and all(n > 0 for n in counts)
        assert backend.read_bytes("rep/obj") == data

    def test_a_suspended_write_stores_nothing_and_reuses_nothing_for_other_bytes(
        self, backend: Backend
    ) -> None:
        size = self.large_size // 2
        out = backend.open_write("sus/obj")
        out.write(_payload(size, seed=8)[: size - 1])  # parts acknowledged, the last held back
        out.suspend()
        assert not backend.exists("sus/obj")
        other = _payload(size, seed=9)
        try:
            with backend.open_write("sus/obj") as again:
                again.write(other)
        except TransientStorageError:  # the store holds bytes it cannot replace: sent again whole
            with backend.open_write("sus/obj") as again:
                again.write(other)
        assert backend.read_bytes("sus/obj") == other

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

    def test_a_small_read_meets_a_delete_as_not_found(self, backend: Backend) -> None:
        """``read_bytes`` (marks, manifests, leases) reads one version whole: while another
        actor deletes and re-publishes the key, a read gives a whole version or
        :class:`ObjectNotFound`, never a read error. Callers act on "not found" (a mark or
        manifest removed since it was listed); a migrator that met a stat-then-read race
        here failed a migration another migrator had just committed."""
        versions = [bytes([65 + s]) * (700 * (s + 1)) for s in range(3)]
        backend.publish("sr/k", versions[0])
        done = threading.Event()
        churned = [0]

        def churn() -> None:
            while not done.is_set():
                backend.delete("sr/k")
                churned[0] += 1
                backend.publish("sr/k", versions[churned[0] % 3])

        seen: list[Any] = []
        churner = threading.Thread(target=churn)
        churner.start()
        deadline = time.monotonic() + 60
        try:  # read on until the key was replaced often enough to meet the reads
            while (len(seen) < 150 or churned[0] < 30) and time.monotonic() < deadline:
                time.sleep(0)  # let the churner run between reads (the GIL)
                try:
                    data = backend.read_bytes("sr/k", limit=1 << 20)
                except ObjectNotFound:
                    seen.append("gone")
                    continue
                seen.append(versions.index(data) if data in versions else f"{len(data)} bytes")
        finally:
            done.set()
            churner.join()
        odd = [s for s in seen if s != "gone" and not isinstance(s, int)]
        assert odd == [], f"{len(odd)} reads saw no whole version, e.g. {odd[:5]}"
        assert churned[0] >= 30, "the key was hardly replaced: the test proved nothing"

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
            (len(data) + 10, 5),  # past the end: nothing
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
