"""Runs: which of a store's checkpoints belong to this manager's run (docs/operations.md, "Runs").

A new run pointed at an old run's directory used to resume the old run's weights without a
word (same model), or fail with DCP's size mismatch (another model) without a hint that the
directory holds another run. A manager given a run name (``CheckpointManager(run="B")``, or
``run=RunOptions("B", strict=True)``) records it in every manifest it saves, and its
``load_latest`` resumes only checkpoints recorded with that name: another run's, those of
no named run (a job id alone) and those saved before runs were recorded are passed over,
never loaded, and the resume fallback past a damaged checkpoint (and its quarantine) stays
among its own. ``load(step=)`` and ``load(name=)`` load any checkpoint, with a warning
naming both runs.

At start the coordinator lists the hot tier once (never the cold tier: construction sends it
no request, and it may be down) and names the other runs there in one warning, or, with
``strict``, raises :class:`~tierstore.errors.ConfigError` on every rank before anything is
saved. Checkpoints of other runs that only the cold tier holds are reported the same way by
the first ``load_latest``, which lists every tier anyway. Each other run is named once.

Without a run name nothing changes: ``load_latest`` resumes the newest checkpoint, whoever
saved it (a job submitted again gets a new scheduler id and must resume its own), and the
job id a manifest records is for display only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from tierstore import _dist
from tierstore.dcp import structure
from tierstore.dcp.failures import causes
from tierstore.dcp.reader import TieredReader
from tierstore.errors import ConfigError, TierstoreError
from tierstore.format.manifest import Manifest, checkpoint_order
from tierstore.lifecycle.retention import Policy, within_run
from tierstore.options import RunOptions
from tierstore.tiers.catalog import CheckpointInfo, list_checkpoints
from tierstore.tiers.tier import Store, Tier

__all__ = ["RunGuard", "StructureMismatch", "run_of", "ours", "whose"]

log = logging.getLogger(__name__)

# DCP's words for a state that does not fit a checkpoint (torch's default_planner.py).
_MISMATCH = re.compile(r"Size mismatch|Missing key|Unexpected key")


class StructureMismatch(ConfigError, CheckpointException):
    """The state does not match the checkpoint being loaded (a state or a choice of checkpoint
    to fix: a :class:`~tierstore.errors.ConfigError`), raised where DCP raised its
    ``CheckpointException``, which it is too: code catching either catches it."""

    def __init__(self, message: str, *, failures: Mapping[int, Any] | None = None, **context: Any) -> None:
        ConfigError.__init__(self, message, **context)
        self._failures = dict(failures or {})

    def __str__(self) -> str:
        return Exception.__str__(self)  # the message, not DCP's per-rank tracebacks


def run_of(value: str | RunOptions | None) -> RunOptions | None:
    """``CheckpointManager(run=)`` as a :class:`~tierstore.RunOptions`: a name is ``RunOptions(name)``."""
    if value is None or isinstance(value, RunOptions):
        return value
    if isinstance(value, str):
        return RunOptions(value)
    raise ConfigError(
        f"CheckpointManager(run=) takes a run name or a tierstore.RunOptions, got {type(value).__name__}"
    )


def ours(checkpoint: CheckpointInfo | Manifest, run: RunOptions | None) -> bool:
    """Whether a manager of ``run`` resumes ``checkpoint`` without being asked for it: any, without a
    run name; else only one whose manifest names that very run."""
    return run is None or checkpoint.run == run.name


def whose(checkpoint: CheckpointInfo | Manifest) -> str:
    """The run of ``checkpoint`` as a message says it."""
    if checkpoint.run is not None:
        return f"run {checkpoint.run!r}"
    if checkpoint.job is not None:
        return f"no named run ({checkpoint.job})"
    return "no recorded run"


def _others(listed: Iterable[CheckpointInfo], run: RunOptions) -> dict[str, tuple[int, CheckpointInfo]]:
    """Each other run of ``listed`` (by :func:`whose`): how many checkpoints, and its newest."""
    found: dict[str, tuple[int, CheckpointInfo]] = {}
    for info in sorted(listed, key=checkpoint_order):
        if not ours(info, run):
            label = whose(info)
            found[label] = (found.get(label, (0, info))[0] + 1, info)
    return found


def _named(others: Mapping[str, tuple[int, CheckpointInfo]]) -> str:
    return "; ".join(
        f"{label}: {count} checkpoint{'s' if count > 1 else ''}, the newest {info.name} (step {info.step})"
        for label, (count, info) in others.items()
    )


class RunGuard:
    """The run rule of a manager (module docstring): which checkpoints a load may pick, what
    its retention may prune, and the other runs a store holds, each named once."""

    def __init__(self, run: RunOptions | None) -> None:
        self.run = run
        self._reported: set[str] = set()  # the other runs already named in a warning

    @property
    def name(self) -> str | None:
        """The name its saves record, ``None`` without a run."""
        return self.run.name if self.run is not None else None

    def own(self, policy: Policy) -> Policy:
        """``policy``, over this run's checkpoints alone when the run is named (another run's
        are never this run's to prune)."""
        return policy if self.run is None else within_run(self.run.name, policy)

    def check_start(self, hot: Tier | None, group: Any, distributed: bool) -> None:
        """At start: one listing of the hot tier by the coordinator; another run's
        checkpoints there are warned about once, or, ``strict``, a ``ConfigError`` raised on
        every rank (the constructor's, before anything is saved). Best effort: a listing that
        fails is a debug line."""
        run = self.run
        if run is None or hot is None:
            return
        problem: ConfigError | None = None
        if _dist.group_rank_world(group)[0] == 0:
            try:
                listed = list_checkpoints(Store.of_tiers(hot, None))
            except TierstoreError as err:
                log.debug("could not list %s for the runs it holds: %s", hot.label, err)
                listed = []
            except Exception:  # best effort, as the run lock: never fails a start
                log.warning("could not look for other runs' checkpoints in %s", hot.label, exc_info=True)
                listed = []
            problem = self._other_runs(listed, hot.label)
        if run.strict and distributed:
            problem = _dist.broadcast(problem, group)
        if problem is not None:
            raise problem

    def _other_runs(self, listed: Sequence[CheckpointInfo], where: str) -> ConfigError | None:
        """Name the other runs of ``listed`` not named before: a warning, or the error that
        ``strict`` raises instead."""
        run = self.run
        assert run is not None
        others = {k: v for k, v in _others(listed, run).items() if k not in self._reported}
        if not others:
            return None
        self._reported.update(others)
        if run.strict:
            return ConfigError(
                f"CheckpointManager(run=RunOptions({run.name!r}, strict=True)): {where} holds checkpoints "
                f"of other runs ({_named(others)}); nothing was saved. Give run {run.name!r} a "
                f"directory of its own, or pass run={run.name!r} to resume only its own "
                "checkpoints beside them",
                tier=where,
            )
        log.warning(
            "%s holds checkpoints of other runs than this manager's run %r: %s. This manager "
            "resumes only checkpoints of run %r (load_latest passes over these; load(step=...) "
            "or load(name=...) loads one of them). In one directory its saves of the steps "
            "they hold are refused (CheckpointExists); its retention counts and prunes only "
            "its own: give each run a directory of its own",
            where,
            run.name,
            _named(others),
            run.name,
        )
        return None

    def resumable(
        self, listed: Sequence[CheckpointInfo], step: int | None, where: str
    ) -> list[CheckpointInfo]:
        """Of ``listed`` (oldest first, from ``where``), those a load without a name may pick: of
        ``step``, this run's if it has some, else any (asked for by step); without, this run's
        only (the others named once, or ``strict``'s error raised)."""
        if step is not None:
            of_step = [c for c in listed if c.step == step]
            return [c for c in of_step if ours(c, self.run)] or of_step
        if self.run is None:
            return list(listed)
        problem = self._other_runs(listed, where)
        if problem is not None:
            raise problem
        return [c for c in listed if ours(c, self.run)]

    def loaded(self, manifest: Manifest) -> None:
        """Say which run's checkpoint a load loaded (the coordinator's word for the job)."""
        if ours(manifest, self.run):
            log.info("loaded checkpoint %s (step %s) of %s", manifest.name, manifest.step, whose(manifest))
            return
        assert self.run is not None
        log.warning(
            "loaded checkpoint %s (step %s) of %s into this manager's run %r, as asked for by "
            "name or step; load_latest resumes only checkpoints of run %r",
            manifest.name,
            manifest.step,
            whose(manifest),
            self.run.name,
            self.run.name,
        )

    def raise_if_mismatched(
        self, err: CheckpointException, reader: TieredReader, planner: Any, name: str
    ) -> None:
        """DCP's "the state does not fit" errors become one naming the checkpoint, its step,
        run and world size, and whether its structure differs from the state's."""
        cause = next((c for c in causes(err) if _MISMATCH.search(str(c))), None)
        manifest = reader.manifest
        if cause is None or manifest is None:
            return
        saved, here = manifest.fingerprint, None
        metadata, state = getattr(planner, "metadata", None), getattr(planner, "state_dict", None)
        if saved is None and isinstance(metadata, Metadata):
            saved = structure.of_metadata(metadata)
        if isinstance(state, Mapping):
            try:
                here = structure.of_state(state)
            except Exception:  # a planner's state of its own: the message goes without
                log.debug("could not fingerprint the state being loaded", exc_info=True)
        differs = (
            f" Its structure differs from the state's (fingerprint {saved[:19]}... saved, "
            f"{here[:19]}... being loaded)."
            if saved is not None and here is not None and saved != here
            else ""
        )
        if self.run is None:
            hint = (
                " A checkpoint of another run or model? Give this run a directory of its own, "
                "or name its run (CheckpointManager(run=...)) so that load_latest resumes only "
                "its own checkpoints."
            )
        elif not ours(manifest, self.run):
            hint = f" This manager is run {self.run.name!r}; the checkpoint was asked for by name or step."
        else:
            hint = " The state's structure changed since the save?"
        raise StructureMismatch(
            f"the state does not match checkpoint {manifest.name} (step {manifest.step}, "
            f"{whose(manifest)}, saved by {manifest.world_size} rank"
            f"{'s' if manifest.world_size > 1 else ''}): {str(cause).rstrip('.')}.{differs}{hint}",
            checkpoint=name,
            failures=err.failures,
        ) from err
