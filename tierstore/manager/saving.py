"""Saving: the futures pipeline of one save at a time (``dcp.save`` or ``dcp.async_save``
through a ``TieredWriter``), staged into reused buffers, its failure recorded and raised once."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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
from tierstore.errors import ConfigError, SaveFailed
from tierstore.format.manifest_format import check_metrics
from tierstore.manager.base import Base
from tierstore.staging import AlreadyStaged, ReusedStaging, resolve_stateful, staging_options

if TYPE_CHECKING:
    pass

__all__ = ["Saving"]

log = logging.getLogger(__name__)


class Saving(Base):
    """Saving of :class:`~tierstore.manager.CheckpointManager` (module docstring)."""

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        force: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Checkpoint ``state`` as ``step`` if the cadence wants it (or ``force``); ``True`` if saved.

        Returns once the state is copied (unless ``StagingOptions(overlap=True)``): training may change
        it from then on. A synchronous save, or a copy of the state, that fails raises
        :class:`~tierstore.errors.SaveFailed` at once. If the previous (background) save
        failed, this save still goes ahead, and once it is under way (its state copied,
        unless ``overlap=True``) the previous failure is raised:
        :class:`~tierstore.errors.SaveFailed` whose ``step`` is the failed one's, not
        ``step``, so a loop that catches it and goes on misses no save (a full disk that
        frees up saves the very next step). If this save fails at
        once too, its own failure is raised instead; the earlier one stays logged and
        counted in :meth:`health`. Either way each failure is raised once.

        ``metrics`` (``{"val_loss": 0.41}``: at most 64 names, finite numbers) are recorded
        in this checkpoint's manifest, for :class:`~tierstore.lifecycle.retention.keep_best`
        and ``CheckpointInfo.metrics``; the coordinator's are the ones recorded. Invalid
        metrics raise :class:`~tierstore.errors.ConfigError` before anything is saved.
        """
        self._end_if_notice_ignored()  # a notice acted on, and the loop went on: the run ends
        since = self._preemption_seen()  # every call: combined across ranks (preemption.py)
        if not (force or since is not None or self.should_save(step)):
            return False
        metrics = check_metrics(metrics, source="metrics", error=ConfigError) if metrics else {}
        if since is not None:
            return self._save_on_preemption(step, state, metrics, since)
        writer = self._writer(step, metrics)  # a step no manifest can record raises here
        start = time.perf_counter()
        self._finish_previous()  # block the next save only until the previous flush is done
        # A failed background save is raised, but only once this step's save is under way:
        # skipping it lost every other step while a disk was full or two jobs shared a
        # directory (issue 38), and a rank that skips leaves the others in its collectives.
        previous = self._take_failure()
        self._start_save(step, state, writer)
        self.stalls[step] = time.perf_counter() - start
        if previous is not None:
            raise _went_ahead(previous, step)
        return True

    def _start_save(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """Start (or, synchronous, make) the save of ``step``, as ``staging`` says; a failure
        seen on the caller's thread is raised here, one of the background save later."""
        if not self.staging.async_save:
            self._save_sync(step, state, writer)
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
            self._raise_failure()
            raise
        assert isinstance(copy, dict)  # staged on this thread: the copy itself, no future
        staged: Future[None] = Future()  # the copy is taken: nothing waits for this one
        settled: Future[None] = Future()
        self._pending = settled
        start_save = functools.partial(
            self._start_async, step, copy, writer, staged, settled, AlreadyStaged()
        )
        self._submitter().submit(self._guarded, start_save, step, staged, settled)

    def _save_sync(self, step: int, state: dict[str, Any], writer: TieredWriter) -> None:
        """``dcp.save`` through ``writer``: committed in the hot tier when it returns."""
        self._relieve_disk_pressure()
        try:
            dcp_save(state, storage_writer=writer, process_group=self.group)
        except (Exception, CheckpointException) as err:  # a BaseException, in DCP
            self._failed(step, err)
            self._raise_failure()
            raise
        self._committed(step, None)

    def _writer(self, step: int, metrics: Mapping[str, float]) -> TieredWriter:
        return TieredWriter(
            self.store,
            step=step,
            migration=self.migration,
            metrics=metrics,
            run=self.run.name if self.run is not None else None,
            options=self.writer,
        )

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
            self._relieve_disk_pressure()
            response = dcp_async_save(
                state,
                storage_writer=writer,
                process_group=self.group,
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
            self._finish_previous()
            self._raise_failure()
            raise

    def _finish_previous(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:  # a save can settle before its staging future does
            try:
                staging.result()
            except BaseException:  # the save fails with it: raised by _raise_failure
                pass
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # recorded by _committed, raised by _raise_failure
                pass

    def _failed(self, step: int, err: BaseException) -> None:
        failure = save_failed(step, err)
        log.error("%s", failure)
        with self._lock:
            self.last_error = err
            self._last_failure = str(failure)
            self._saves_failed += 1
            self._unraised = failure

    def _take_failure(self) -> SaveFailed | None:
        with self._lock:
            failure, self._unraised = self._unraised, None
        return failure

    def _raise_failure(self) -> None:
        failure = self._take_failure()
        if failure is not None:
            raise failure

    def _committed(self, step: int, future: Future[Any] | None) -> None:
        error = future.exception() if future is not None else None
        if error is not None:
            self._failed(step, error)
            return
        with self._lock:
            self._saves_ok += 1
            self._last_saved_step = step
        if (self.rank == 0 or self.node_local) and not self._in_grace():
            self._prune_in_background()  # in a notice's grace period, the next run prunes


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
