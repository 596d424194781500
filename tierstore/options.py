"""The options objects of the constructors: typed, frozen, checked when built.

A constructor takes tier names, the identity of what it works on (a step, a name) and a few
of these; an unknown option is a ``TypeError`` and an ill-typed or out-of-range one a
:class:`~tierstore.errors.ConfigError` naming it, both where the object is built, never at
the first save (which may be hours into a run). Orbax's ``CheckpointManager`` is the model:
a handful of parameters plus nested option dataclasses.

- :class:`WriterOptions`: how :class:`~tierstore.TieredWriter` writes a checkpoint.
- :class:`ReaderOptions`: how :class:`~tierstore.TieredReader` reads one.
- :class:`StagingOptions`: how :class:`~tierstore.CheckpointManager` takes the state off the
  training loop (DCP's ``async_save``, its mode and the staging buffers).
- :class:`PreemptionOptions`: which signals the manager takes as a preemption notice, and the grace
  period it saves within (:mod:`tierstore.manager.preemption`).
- :class:`RunOptions`: the run a :class:`~tierstore.CheckpointManager` saves and resumes, and whether
  a store holding another run's checkpoints is an error (``CheckpointManager(run=)``).
- :class:`~tierstore.MigrationOptions` (:mod:`tierstore.migration.jobs`): how a process migrates.
- :class:`~tierstore.Retention` (:mod:`tierstore.lifecycle.retention`): what each tier keeps.

The module imports no torch, so ``from tierstore import WriterOptions`` stays cheap.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tierstore.errors import ConfigError
from tierstore.format.manifest_format import check_run

if TYPE_CHECKING:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

__all__ = [
    "WriterOptions",
    "ReaderOptions",
    "StagingOptions",
    "PreemptionOptions",
    "RunOptions",
    "ManagerOptions",
    "Encoding",
    "StagingMode",
    "StagingBuffers",
]

Encoding = Literal["raw", "dcp"]
StagingMode = Literal["thread", "process"]
StagingBuffers = Literal["reuse", "fresh"]
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be True or False, got {value!r}")


def check_positive(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


def check_choice(
    owner: str, name: str, value: object, choices: Collection[str], *, optional: bool = False
) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in choices:
        shown = " or ".join(repr(c) for c in choices)
        raise ConfigError(f"{owner}.{name} must be {shown}, got {value!r}")


@dataclass(frozen=True)
class WriterOptions:
    """How :class:`~tierstore.TieredWriter` writes a checkpoint (``TieredWriter(options=)``,
    ``CheckpointManager(writer=)``).

    Args:
        thread_count: write threads per rank, as in DCP's ``FileSystemWriter``.
        single_file_per_rank: one file per thread per rank (default), or one per item.
        encoding: ``"raw"``: tensors' bytes as they are, read by ``TieredReader`` only;
            ``"dcp"``: ``FileSystemWriter``'s format, also loadable by plain DCP. ``None``
            (default): ``"raw"``, or ``"dcp"`` when ``extensions`` are given. See docs/format.md.
        extensions: DCP stream transforms (``ZStandard()``) applied to each stored item, as
            ``FileSystemWriter(_extensions=)``; they need ``encoding="dcp"``.
        manifest_part_ranks: ranks per part of a two-level manifest; a checkpoint of no more
            ranks keeps the flat manifest. ``None``: the environment variable
            ``TIERSTORE_MANIFEST_PART_RANKS``, else 1024 (read when the writer is built).
        max_files_per_dir: when the attempt directory would hold more shard files, they go to
            ``r<k>/`` subdirectories by rank. ``None``: ``TIERSTORE_MAX_FILES_PER_DIR``, else
            4096.
    """

    thread_count: int = 1
    single_file_per_rank: bool = True
    encoding: Encoding | None = None
    extensions: Sequence[StreamTransformExtension] = field(default=())
    manifest_part_ranks: int | None = None
    max_files_per_dir: int | None = None

    def __post_init__(self) -> None:
        owner = "WriterOptions"
        check_positive(owner, "thread_count", self.thread_count)
        check_bool(owner, "single_file_per_rank", self.single_file_per_rank)
        check_choice(owner, "encoding", self.encoding, ("raw", "dcp"), optional=True)
        check_positive(owner, "manifest_part_ranks", self.manifest_part_ranks, optional=True)
        check_positive(owner, "max_files_per_dir", self.max_files_per_dir, optional=True)
        if isinstance(self.extensions, (str, bytes)) or not isinstance(self.extensions, Sequence):
            raise ConfigError(
                f"{owner}.extensions must be a sequence of DCP extensions, got {self.extensions!r}"
            )
        # A tuple, so the options stay hashable and no caller's list changes them later.
        object.__setattr__(self, "extensions", tuple(self.extensions))
        if self.extensions:
            _check_extensions(self.extensions)
            if self.encoding == "raw":
                raise ConfigError(
                    f"{owner}.extensions need encoding='dcp' (got 'raw'): the raw encoding "
                    "reads byte ranges of items in place, which a compressed stream has not; "
                    "pass encoding='dcp', or drop the extensions"
                )

    @property
    def resolved_encoding(self) -> Encoding:
        """The encoding a save writes: ``encoding``, else what the extensions need."""
        if self.encoding is not None:
            return self.encoding
        return "dcp" if self.extensions else "raw"


def _check_extensions(extensions: Sequence[Any]) -> None:
    # Imported here: only a writer given extensions needs torch for this check.
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    for ext in extensions:
        if not isinstance(ext, StreamTransformExtension):
            raise ConfigError(
                "WriterOptions.extensions (FileSystemWriter's _extensions) takes DCP "
                f"StreamTransformExtension objects (such as ZStandard()), got {type(ext).__name__}"
            )


@dataclass(frozen=True)
class ReaderOptions:
    """How :class:`~tierstore.TieredReader` reads a checkpoint (``TieredReader(options=)``).

    Args:
        thread_count: read threads per rank for raw-encoded files: files in parallel, and a
            large file split by items (each part its own ranged requests).
        lease: announce the load with a lease in each tier read (:mod:`tierstore.tiers.leases`)
            so a concurrent prune leaves its files alone. Without write access to a tier
            (read-only credentials) the load goes on unleased there, with one warning.
        resolve_once: under a process group of more than one rank, the coordinator alone
            lists the catalog, picks and leases the checkpoint, and every other rank reads
            that checkpoint's manifest by name. It needs every rank of the group to call
            ``dcp.load`` (see ``TieredReader``); ``CheckpointManager`` turns it on.
    """

    thread_count: int = 1
    lease: bool = True
    resolve_once: bool = False

    def __post_init__(self) -> None:
        check_positive("ReaderOptions", "thread_count", self.thread_count)
        check_bool("ReaderOptions", "lease", self.lease)
        check_bool("ReaderOptions", "resolve_once", self.resolve_once)


@dataclass(frozen=True)
class StagingOptions:
    """How :class:`~tierstore.CheckpointManager` takes the state off the training loop
    (``CheckpointManager(staging=)``). Not DCP's ``StagingOptions``, which the manager builds
    for its stager from these and the machine (:mod:`tierstore.staging`).

    Args:
        async_save: save with ``dcp.async_save`` (default) or ``dcp.save``.
        mode: ``"thread"`` (default) or ``"process"``, DCP's async checkpointer types.
        buffers: ``"reuse"`` (default) copies the state into buffers kept from save to save;
            ``"fresh"`` is DCP's default, new buffers on every save (for comparison).
        overlap: ``save()`` returns as soon as the copy has started, not once it is taken;
            the caller must not change the state until ``wait_staged()`` returns (the next
            ``save``, ``wait`` and ``close`` wait for it too). Needs ``async_save`` and
            ``buffers="reuse"``.
    """

    async_save: bool = True
    mode: StagingMode = "thread"
    buffers: StagingBuffers = "reuse"
    overlap: bool = False

    def __post_init__(self) -> None:
        owner = "StagingOptions"
        check_bool(owner, "async_save", self.async_save)
        check_choice(owner, "mode", self.mode, ("thread", "process"))
        check_choice(owner, "buffers", self.buffers, ("reuse", "fresh"))
        check_bool(owner, "overlap", self.overlap)
        if self.overlap and not (self.async_save and self.buffers == "reuse"):
            raise ConfigError(
                "StagingOptions.overlap needs async_save=True and buffers='reuse' "
                f"(got async_save={self.async_save!r}, buffers={self.buffers!r}): other saves "
                "copy the state before save() returns"
            )


@dataclass(frozen=True)
class PreemptionOptions:
    """How :class:`~tierstore.CheckpointManager` meets a preemption notice
    (``CheckpointManager(preemption=)``; :mod:`tierstore.manager.preemption`).

    Schedulers send a signal and then wait a grace period before SIGKILL: Slurm ``SIGTERM``
    (or the signal ``--signal`` names, e.g. ``SIGUSR1``) and ``KillWait`` (30 s by default),
    Kubernetes ``SIGTERM`` and ``terminationGracePeriodSeconds`` (30 s), spot and
    preemptible VMs about 30 s to 2 min.

    Args:
        signals: the signals taken as the notice (default ``SIGTERM``); the manager's handler
            records the request and calls the handler installed before it, if that is a Python
            function (the default action, ending the process, is not taken).
        grace_seconds: the budget from the signal to the process's exit (default 30): the next
            ``save()`` saves that step to the hot tier, then spends what is left of the budget,
            less a margin for the exit, pushing it to the cold tier.
    """

    signals: tuple[int, ...] = (signal.SIGTERM,)
    grace_seconds: float = 30.0

    def __post_init__(self) -> None:
        signals = self.signals
        if not (isinstance(signals, (tuple, list)) and signals):
            raise ConfigError(
                f"PreemptionOptions.signals must be a non-empty tuple of signals, got {signals!r}"
            )
        valid = signal.valid_signals()
        for number in signals:
            if isinstance(number, bool) or not isinstance(number, int) or number not in valid:
                raise ConfigError(f"PreemptionOptions.signals: {number!r} is not a signal of this system")
            if number in _UNCATCHABLE:
                raise ConfigError(
                    f"PreemptionOptions.signals: {signal.Signals(number).name} cannot be caught "
                    "(it is what comes after the grace period)"
                )
        object.__setattr__(self, "signals", tuple(signal.Signals(n) for n in signals))
        grace = self.grace_seconds
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (0 < grace < math.inf):
            raise ConfigError(
                f"PreemptionOptions.grace_seconds must be a number of seconds > 0, got {grace!r}"
            )


@dataclass(frozen=True)
class RunOptions:
    """The run a :class:`~tierstore.CheckpointManager` belongs to (``CheckpointManager(run=)``;
    ``run="name"`` is ``RunOptions("name")``). docs/operations.md, "Runs", has the rules.

    Args:
        name: recorded in every manifest the manager saves (``CheckpointInfo.run``): 1 to 128
            printable characters, no ``/``, no space at either end. Its ``load_latest`` resumes
            only checkpoints recorded with this name; ``load(step=)`` and ``load(name=)``
            load another run's, with a warning.
        strict: a store holding checkpoints of another run (or of none named) is a
            :class:`~tierstore.errors.ConfigError` when the manager is built, or at its first
            ``load_latest`` for those only the cold tier holds, instead of a warning.
    """

    name: str
    strict: bool = False

    def __post_init__(self) -> None:
        check_run(self.name, what="name", source="RunOptions", error=ConfigError)
        check_bool("RunOptions", "strict", self.strict)


@dataclass(frozen=True)
class ManagerOptions:
    """What :class:`~tierstore.CheckpointManager` itself needs beyond the store, its cadence
    and the options of its parts (``CheckpointManager(options=)``).

    Args:
        close_timeout: the most seconds ``close()`` waits for migrations, pruning and checks
            in all (default 300); what is left then stays pending in the hot tier and
            ``close()`` raises :class:`~tierstore.errors.MigrationFailed`.
        process_group: the group for the checkpoint collectives; by default (``None``) the
            manager makes a gloo group of its own, so they never interleave with training's.
        redundancy: copies of each checkpoint on other nodes, for a node-local store
            (``Store(hot, cold, node_local=True)``): :class:`~tierstore.Replicas` or
            :class:`~tierstore.Parity` (default ``None``: none). After each commit every rank's
            files go, in the background, to other nodes' hot tiers, verified; a checkpoint so
            protected is found and resumed from the surviving nodes with the cold tier
            unreachable, and a node replaced by an empty one gets its files back from the
            others when the manager starts (docs/operations.md, "Copies on other nodes").
        node_of: ``rank -> node`` for those copies; by default ``rank // LOCAL_WORLD_SIZE``,
            as torchrun numbers nodes.
    """

    close_timeout: float = 300.0
    process_group: Any = None
    redundancy: Any = None  # Replicas | Parity | None, checked by the manager (a layer above)
    node_of: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        timeout = self.close_timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 <= timeout < math.inf):
            raise ConfigError(f"close_timeout must be a number of seconds >= 0, got {timeout!r}")
        object.__setattr__(self, "close_timeout", float(timeout))
