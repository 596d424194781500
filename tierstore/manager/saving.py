"""Saving: the futures pipeline of one save at a time (``dcp.save`` or ``dcp.async_save``
through a ``TieredWriter``), staged into reused buffers, its failure recorded and raised once."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore.dcp.failures import save_failed
from tierstore.dcp.writer import TieredWriter
from tierstore.errors import SaveFailed
from tierstore.manager.group import Group
from tierstore.options import StagingOptions
from tierstore.staging import AlreadyStaged, ReusedStaging, resolve_stateful, staging_options

__all__ = ["SavePipeline", "Tally"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tally:
    """What a manager's saves came to, for ``health()``."""

    ok: int
    failed: int
    last_step: int | None
    last_error: str | None  # the newest failure, "step N: ..."


class SavePipeline:
    """A manager's saves, one at a time (module docstring), on ``group``, as ``staging`` says.

    ``before_write`` runs before each save writes (the hot tier's free-space relief);
    ``committed(step)`` after each save committed; ``settled(step)`` after each save
    committed or failed, on every rank (the copies on other nodes: :mod:`tierstore.manager.copies`).
    A failure is recorded, logged and raised once: by the next :meth:`save`, or
    :meth:`raise_failure`.
    """

    def __init__(
        self,
        staging: StagingOptions,
        group: Group,
        *,
        before_write: Callable[[], None],
        committed: Callable[[int], None],
        settled: Callable[[int], None] | None = None,
    ) -> None:
        self.staging, self._group = staging, group
        self._before_write, self._on_commit = before_write, committed
        self._on_settle = settled or (lambda step: None)
        self._stager: ReusedStaging | None = None  # made by the first save, freed by release()
        self._staging: Future[None] | None = None  # the last save's copy of the state
        self._thread: ThreadPoolExecutor | None = None  # the manager's save thread
        self._pending: Future[None] | None = None  # settles once the save is recorded
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None
        self._unraised: SaveFailed | None = None  # a failed save not yet raised to the caller
        self._last_failure: str | None = None
        self._saves_ok = self._saves_failed = 0
        self.last_saved_step: int | None = None
        self.stalls: dict[int, float] = {}  # step -> seconds the caller was blocked by save()
        self.staging_allocated: dict[int, int] = {}  # step -> bytes its staging allocated

    def tally(self) -> Tally:
        with self._lock:
            return Tally(self._saves_ok, self._saves_failed, self.last_saved_step, self._last_failure)

    def save(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """Save ``state`` as ``step`` through ``writer``, once the previous save's flush is done;
        then raise the previous save's failure, if it failed (:meth:`CheckpointManager.save`)."""
        start = time.perf_counter()
        self.finish_previous()  # block the next save only until the previous flush is done
        # A failed background save is raised, but only once this step's save is under way:
        # skipping it lost every other step while a disk was full or two jobs shared a
        # directory (issue 38), and a rank that skips leaves the others in its collectives.
        previous = self.take_failure()
        self._start_save(step, state, writer)
        self.stalls[step] = time.perf_counter() - start
        if previous is not None:
            raise _went_ahead(previous, step)

    def release(self) -> None:
        """Stop the save thread (idle: the last save settled) and free the staging buffers (a
        later save makes new ones)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _start_save(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """Start (or, synchronous, make) the save of ``step``, as ``staging`` says; a failure
        seen on the caller's thread is raised here, one of the background save later."""
        if not self.staging.async_save:
            self.save_sync(step, state, writer)
        elif self.staging.overlap:
            # Even starting an async save costs tens of ms in DCP (flattening the state,
            # planning); the manager's own thread pays that too, with the copy after it.
            staged: Future[None] = Future()
            self._staging, self._pending = staged, Future()
            settled = self._pending
            start_save = functools.partial(self._start_async, step, state, writer, staged, settled)
            self._submitter().submit(self._guarded, start_save, step, staged, settled)
        elif self.staging.mode == "thread" and self.staging.buffers == "reuse":
            self._save_copied_here(step, state, writer)
        else:
            staged = Future()
            self._staging, self._pending = staged, Future()
            self._start_async(step, state, writer, staged, self._pending)
            self.wait_staged()

    def _save_copied_here(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """The default save: only the copy of the state on the caller's thread, into the reused
        buffers; DCP's async save of that copy is started on the manager's thread. Starting it
        here would stall training for more than the copy: ``dcp.async_save`` logs every
        entry of the state, checks each against the ``Stateful`` protocol and starts a thread
        of its own before it copies (docs/benchmarks.md, "Staging paid once")."""
        stager = self._stager_for_save(background=False)
        assert stager is not None  # buffers="reuse"
        try:
            copy = stager.stage(resolve_stateful(state))
        except (Exception, CheckpointException) as err:  # a BaseException, in DCP
            self._failed(step, err)
            self.raise_failure()
            raise
        assert isinstance(copy, dict)  # staged on this thread: the copy itself, no future
        staged: Future[None] = Future()  # the copy is taken: nothing waits for this one
        settled: Future[None] = Future()
        self._pending = settled
        start_save = functools.partial(
            self._start_async, step, copy, writer, staged, settled, AlreadyStaged()
        )
        self._submitter().submit(self._guarded, start_save, step, staged, settled)

    def save_on_notice(
        self, step: int, state: dict[str, Any], writer: Callable[[], TieredWriter], after: Callable[[], Any]
    ) -> None:
        """The save on a preemption notice (:mod:`tierstore.manager.notice`): synchronous, after
        the save in flight (whose failure is logged, not raised: this one matters now), unless
        that one was this step's; then ``after()`` (the copies on other nodes, before the cold
        tier: they take the network, not the object store)."""
        try:
            self.finish_previous()
            self.raise_failure()
        except SaveFailed as err:  # that save is lost either way
            log.error("the save before the preemption notice failed (%s); saving step %d", err, step)
        if step != self.last_saved_step:  # else saved already: push that one
            self.save_sync(step, state, writer())
        after()

    def save_sync(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """``dcp.save`` through ``writer``: committed in the hot tier when it returns."""
        self._before_write()
        try:
            dcp_save(state, storage_writer=writer, process_group=self._group.group)
        except (Exception, CheckpointException) as err:  # a BaseException, in DCP
            self._failed(step, err)
            self.raise_failure()
            raise
        self._committed(step, None)

    def _submitter(self) -> ThreadPoolExecutor:
        if self._thread is None:  # one thread: saves start in the order they were asked for
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierstore-save")
        return self._thread

    def _guarded(
        self, start_save: Callable[[], None], step: int, staged: Future[None], settled: Future[None]
    ) -> None:
        """``start_save()`` (:meth:`_start_async`) on the manager's thread, where nothing would
        see an error it raised: whatever it raises fails the save, so no waiter on ``staged``
        or ``settled`` waits for ever."""
        try:
            start_save()
        except BaseException as err:
            if not settled.done():
                self._failed(step, err)
                settled.set_result(None)
            if not staged.done():
                staged.set_exception(err)

    def _start_async(
        self,
        step: int,
        state: dict[str, Any],
        writer: TieredWriter,
        staged: Future[None],
        settled: Future[None],
        stager: AsyncStager | None = None,
    ) -> None:
        """Start DCP's async save; ``staged`` completes when the copy is taken (or failed),
        ``settled`` once the save is recorded as committed or failed. ``stager``: the
        manager's own (:meth:`_stager_for_save`) unless given."""
        process = self.staging.mode == "process"
        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        try:
            self._before_write()
            response = dcp_async_save(
                state,
                storage_writer=writer,
                process_group=self._group.group,
                async_checkpointer_type=kind,
                async_stager=stager if stager is not None else self._stager_for_save(),
            )
        except (Exception, CheckpointException) as err:  # staging or planning failed
            self._failed(step, err)
            staged.set_exception(err)
            settled.set_result(None)
            return
        if isinstance(response, AsyncSaveResponse):
            future, staging = response.upload_completion, response.staging_completion
        else:  # staged before async_save returned
            future, staging = response, None
        _chain(staging, staged)
        stager = self._stager

        # A waiter on DCP's future can wake before its done callbacks ran; waiting on
        # ``settled`` instead sees the save recorded (its failure raised by wait/close/save).
        def settle(done: Future[Any]) -> None:
            try:
                if stager is not None:  # counted before the writer could read the copy
                    self.staging_allocated[step] = stager.new_bytes
                self._committed(step, done)
            finally:
                settled.set_result(None)

        future.add_done_callback(settle)

    def _stager_for_save(self, *, background: bool = True) -> ReusedStaging | None:
        """The manager's stager (one for its life: its buffers are what is reused); it copies on
        its own thread when ``background`` (the stager is made by the first save, which asks
        the same way every save of this manager asks)."""
        if self.staging.buffers == "fresh":
            return None  # DCP's default: a stager of its own per save, closed after it
        if self._stager is None:
            self._stager = ReusedStaging(staging_options(self.staging.mode, background=background))
        return self._stager

    def wait_staged(self) -> None:
        """Block until the last save's copy of the state is taken: from then on the state may
        change. ``save()`` calls this itself unless ``StagingOptions(overlap=True)``.

        Raises :class:`~tierstore.errors.SaveFailed` if taking the copy failed (that save
        then failed).
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        try:
            staging.result()
        except BaseException:  # DCP fails the save with it: record and raise that
            self.finish_previous()
            self.raise_failure()
            raise

    def finish_previous(self) -> None:
        """Wait for the last save to settle (committed or failed: never raises)."""
        staging, self._staging = self._staging, None
        if staging is not None:  # a save can settle before its staging future does
            try:
                staging.result()
            except BaseException:  # the save fails with it: raised by raise_failure
                pass
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # recorded by _committed, raised by raise_failure
                pass

    def _failed(self, step: int, err: BaseException) -> None:
        failure = save_failed(step, err)
        log.error("%s", failure)
        with self._lock:
            self.last_error = err
            self._last_failure = str(failure)
            self._saves_failed += 1
            self._unraised = failure
        self._on_settle(step)

    def take_failure(self) -> SaveFailed | None:
        """The failure not raised yet, taken (``None`` if there is none)."""
        with self._lock:
            failure, self._unraised = self._unraised, None
        return failure

    def raise_failure(self) -> None:
        """Raise the failure not raised yet, if any."""
        failure = self.take_failure()
        if failure is not None:
            raise failure

    def _committed(self, step: int, future: Future[Any] | None) -> None:
        error = future.exception() if future is not None else None
        if error is not None:
            self._failed(step, error)
            return
        with self._lock:
            self._saves_ok += 1
            self.last_saved_step = step
        self._on_settle(step)
        self._on_commit(step)


def _went_ahead(failure: SaveFailed, step: int) -> SaveFailed:
    """``failure``, saying that the save of ``step`` went ahead all the same."""
    said = SaveFailed(
        f"{failure.message}; the save of step {step} went ahead all the same (do not save that step again)",
        **failure.context,
    )
    said.__cause__ = failure.__cause__
    return said


def _chain(source: Future[Any] | None, target: Future[None]) -> None:
    """Complete ``target`` as ``source`` completes (at once if there is none)."""
    if source is None:
        target.set_result(None)
        return

    def forward(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(None)

    source.add_done_callback(forward)
