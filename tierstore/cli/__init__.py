"""The ``tierstore`` command: inspect and operate a store (``python -m tierstore`` too).

Exit codes: 0 success; 1 the operation failed, found damage (``verify``, ``gc``), left
something unmigrated (``migrate``, ``status``), a tier path does not exist, or the cold tier
could not be reached; 2 bad usage (an option, or a tier URL no installed backend serves);
130 interrupted (Ctrl-C). Every error is reported by :func:`_run` (argparse's by :func:`main`)
through :func:`tierstore.cli.common.say_error`: one line on stderr, one JSON object under
``--json``. The options, help texts and examples are in :mod:`tierstore.cli.parser`;
docs/operations.md, "Command reference", lists them too.
"""

from __future__ import annotations

import _thread
import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from tierstore.cli.checks import CommandFailed, require_backends, require_tiers
from tierstore.cli.common import say_error
from tierstore.cli.copy import cmd_cp
from tierstore.cli.export import cmd_export
from tierstore.cli.inspect import cmd_ls, cmd_quarantine, cmd_show, cmd_status, cmd_verify
from tierstore.cli.operate import cmd_gc, cmd_migrate, cmd_prune, cmd_restore, cmd_verify_resume
from tierstore.cli.parser import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, build_parser
from tierstore.cli.usage import cmd_du
from tierstore.errors import BackendNotFound, TierstoreError
from tierstore.progress import ProgressDisplay, size_text

__all__ = ["main", "COMMANDS"]

# The tier a command creates when it is missing (tierstore.cli.checks.require_tiers).
_CREATES = {"migrate": "cold", "restore": "hot"}


COMMANDS = {
    "ls": cmd_ls,
    "show": cmd_show,
    "migrate": cmd_migrate,
    "restore": cmd_restore,
    "status": cmd_status,
    "verify": cmd_verify,
    "gc": cmd_gc,
    "prune": cmd_prune,
    "quarantine": cmd_quarantine,
    "verify-resume": cmd_verify_resume,
    "cp": cmd_cp,
    "export": cmd_export,
    "du": cmd_du,
}


# What an interrupted command has done, and why running it again finishes the job: every
# object write is atomic and every manifest is published last (docs/design.md invariants 2
# and 12), so an interruption leaves nothing a rerun cannot complete.
_RESUME = {
    # migrate, restore: bytes the destination acknowledged; only committed checkpoints count
    # as done (tierstore.cli.operate sets args.committed), the rest are said to be pending.
    "migrate": (
        "uploaded {done} of {total} (stored in the cold tier), {committed} checkpoint(s) "
        "committed there{uncommitted}",
        "run the same `tierstore migrate` again to finish; verified uploads are not sent again",
    ),
    "restore": (
        "copied {done} of {total} into the hot tier, {committed} checkpoint(s) restored{uncommitted}",
        "run the same `tierstore restore` again to finish; verified files are not copied again",
    ),
    "verify": (
        "read {done} of {total}, {finished} checkpoint copies verified in full",
        "nothing was changed; run `tierstore verify` again to check everything",
    ),
    "gc": ("only garbage is deleted, in batches", "run the same `tierstore gc` again to finish"),
    "prune": (
        "a checkpoint is un-published before its data is deleted",
        "run the same `tierstore prune` again to finish; `tierstore gc` removes stray data",
    ),
    # the destination's manifest is published last
    "cp": (
        "copied {done} of {total}, nothing committed at the destination yet",
        "run the same `tierstore cp` again to finish; verified files are not sent again",
    ),
}


def _interrupted(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback
    progress: ProgressDisplay = args.progress
    progress.close()
    done, resume = _RESUME.get(args.command, ("stopped", "nothing was changed"))
    committed: list[str] = getattr(args, "committed", [])
    uncommitted = [label for label in progress.labels if label not in committed]
    done = done.format(
        done=size_text(progress.bytes_done),
        total=size_text(progress.bytes_total),
        finished=len(progress.finished),
        committed=len(committed),
        uncommitted=f" ({', '.join(uncommitted)} not committed)" if uncommitted else "",
    )
    message = f"interrupted: {done}; {resume}"
    return say_error(args.command, args.json, "KeyboardInterrupt", message, EXIT_INTERRUPTED)


_REDELIVER = 0.5  # seconds after a Ctrl-C that it is raised again, until one is caught
_running = threading.Event()  # a command runs: a Ctrl-C redelivered now interrupts it


def _on_sigint(signum: int, frame: object) -> None:
    """Ctrl-C: ``KeyboardInterrupt``, and again every :data:`_REDELIVER` seconds while the
    command still runs. Python drops a ``KeyboardInterrupt`` raised while the main thread is in
    a finalizer (a garbage collection at that moment: "Exception ignored in ..."), which would
    let the command go on as if no Ctrl-C came; ``_interrupted`` ignores SIGINT once one is
    caught, which ends the redelivery."""

    def again() -> None:
        if _running.is_set():
            _thread.interrupt_main(signal.SIGINT)

    timer = threading.Timer(_REDELIVER, again)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(COMMANDS).parse_args(argv)
    except UsageError as err:  # argparse's own: its usage line, then the error, as it prints them
        command = next((a for a in argv if a in COMMANDS), None)
        return say_error(command, "--json" in argv, err.error, str(err), EXIT_USAGE, plain=err.usage)
    if threading.current_thread() is threading.main_thread():
        # Interrupted by Ctrl-C even where the shell started us with SIGINT ignored.
        signal.signal(signal.SIGINT, _on_sigint)
    args.progress = ProgressDisplay(show=not args.json)
    _running.set()
    try:
        return _run(args)
    finally:
        _running.clear()


def _run(args: argparse.Namespace) -> int:
    """The command, and every error it ends with reported in one place (:func:`say_error`)."""
    command, as_json = args.command, args.json
    try:
        if args.hot is None and args.cold is None:
            raise UsageError("give --hot and/or --cold")
        if args.command in ("migrate", "restore", "status") and not (args.hot and args.cold):
            raise UsageError("--hot and --cold are both required")
        require_backends({"hot": args.hot, "cold": args.cold, "to": getattr(args, "to", None)})
        require_tiers({"hot": args.hot, "cold": args.cold}, _CREATES.get(args.command))
        return int(args.func(args))
    except UsageError as err:
        return say_error(command, as_json, err.error, str(err), EXIT_USAGE, where=err.where)
    except CommandFailed as err:
        return say_error(command, as_json, "CommandFailed", str(err), EXIT_ERROR, where=err.where)
    except TierstoreError as err:
        # a URL no backend serves met after require_backends is a usage error all the same
        code = EXIT_USAGE if isinstance(err, BackendNotFound) else EXIT_ERROR
        plain = f"tierstore: {type(err).__name__}: {err}"
        return say_error(
            command, as_json, type(err).__name__, err.message, code, plain=plain, where=err.context
        )
    except KeyboardInterrupt:
        return _interrupted(args)
