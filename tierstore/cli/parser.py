"""The ``tierstore`` command's options, help texts, examples and exit codes.

Kept apart from :mod:`tierstore.cli` (the commands) (what each command does) so that ``tierstore --help``
reads as one document here, and docs/operations.md ("Command reference") is checked against
it by tests/cli/test_cli_usability.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

from tierstore.lifecycle.gc import DEFAULT_GRACE
from tierstore.lifecycle.retention import keep_best

__all__ = [
    "build_parser",
    "UsageError",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "COLD_WAIT",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
COLD_WAIT = 5.0  # seconds `ls` and `status` wait for the cold tier before reporting it down


class UsageError(Exception):
    """Options that cannot work together or are missing, or a tier URL no installed backend
    serves (exit 2, like argparse's own). ``error`` names the type ``--json`` reports (the
    :class:`~tierstore.errors.ConfigError` a tier URL raised, say); ``where`` the tier it is
    about; ``usage``, for the errors argparse found, its text as it prints them."""

    def __init__(self, message: str, *, error: str = "UsageError", usage: str = "", **where: str) -> None:
        super().__init__(message)
        self.error, self.usage, self.where = error, usage, where


class _Parser(argparse.ArgumentParser):
    """argparse, its usage errors raised as :class:`UsageError` (not printed and exited):
    :mod:`tierstore.cli` reports every error in one place, as JSON under ``--json``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, usage=f"{self.format_usage()}{self.prog}: error: {message}")


Command = Callable[[argparse.Namespace], int]

# name: (one-line description, example, what exit code 1 means for it)
_ABOUT = {
    "ls": (
        "list committed checkpoints in every tier, with their migration state",
        "tierstore ls --hot /nvme/run1 --cold s3://ckpt/run1",
        "a tier path does not exist, or the cold tier is unreachable (the hot tier is still listed)",
    ),
    "show": (
        "show one checkpoint's manifest: files, sizes, CRC32Cs, tiers",
        "tierstore show --hot /nvme/run1 --step 2000",
        "no such checkpoint, or a tier path does not exist",
    ),
    "migrate": (
        "finish pending hot -> cold migrations now, in this process",
        "tierstore migrate --hot /nvme/run1 --cold s3://ckpt/run1 --bandwidth 200",
        "a checkpoint could not be migrated, or --name names no hot checkpoint",
    ),
    "restore": (
        "copy a cold checkpoint into the hot tier, repairing damaged hot files",
        "tierstore restore --hot /nvme/run1 --cold s3://ckpt/run1 --step 2000",
        "no such cold checkpoint, or the copy failed",
    ),
    "status": (
        "migration state of every hot checkpoint: pending, uploading, committed, failed",
        "tierstore status --hot /nvme/run1 --cold s3://ckpt/run1",
        "a migration has failed, or the cold tier is unreachable (the hot tier is still listed)",
    ),
    "verify": (
        "re-read every file of every tier and check its size and CRC32C",
        "tierstore verify --hot /nvme/run1 --cold s3://ckpt/run1 --name step-0000002000",
        "damage was found, or --name names no checkpoint",
    ),
    "gc": (
        "delete what no manifest names (a dry run unless --yes)",
        "tierstore gc --hot /nvme/run1 --cold s3://ckpt/run1 --yes",
        "a damaged manifest was found (its data is kept) or an object could not be deleted",
    ),
    "prune": (
        "apply retention policies to each tier (a dry run unless --yes)",
        "tierstore prune --hot /nvme/run1 --cold s3://ckpt/run1 --hot-keep-last 2 --cold-keep-last 3",
        "the prune failed",
    ),
    "quarantine": (
        "list checkpoints a resume found damaged and set aside; remove or restore one",
        "tierstore quarantine --hot /nvme/run1 --cold s3://ckpt/run1 --delete step-0000002000",
        "--delete or --restore names no quarantined checkpoint, the name is committed again by "
        "another attempt, or --delete names the attempt committed now (nothing is deleted: "
        "--restore finishes an interrupted restore)",
    ),
    "verify-resume": (
        "load a checkpoint in fresh processes and check it restores the run",
        "tierstore verify-resume --hot /nvme/run1 --probe train.py:probe --record /tmp/rec",
        "the resumed run differs from the record, or a fresh process failed",
    ),
    # cp: tierstore.cli.copy
    "cp": (
        "copy one committed checkpoint to another tier (a directory or bucket), verified",
        "tierstore cp --hot /nvme/run1 --cold s3://ckpt/run1 --step 2000 --to s3://milestones/run1",
        "no such checkpoint, a source file is damaged in every tier, the destination holds "
        "another attempt of it, or the copy failed (nothing is committed there)",
    ),
    "export": (
        "write a committed checkpoint out as safetensors, one torch.save file or plain DCP",
        "tierstore export --hot /nvme/run1 --cold s3://ckpt/run1 --step 2000 --format safetensors "
        "--out /models/run1-2000 --config /models/base/config.json",
        "no such checkpoint, damage in every copy, --out is not empty, or --force would replace "
        "the current or home directory or a tree holding a tier (nothing is written then)",
    ),
    # du: tierstore.cli.usage
    "du": (
        "bytes per tier and per checkpoint, pending migration bytes, free space",
        "tierstore du --hot /nvme/run1 --cold s3://ckpt/run1",
        "a tier path does not exist, or the cold tier is unreachable (the hot tier is still shown)",
    ),
}
_LONG = {
    "verify-resume": "Load a checkpoint into fresh processes built by a probe and compare the loss "
    "on a fixed batch and every state key with a live record "
    "(see docs/training-state.md)."
}


def _epilog(name: str) -> str:
    _, example, failure = _ABOUT[name]
    return (
        f"example:\n  {example}\n\n"
        f"exit codes:\n  0    success\n  1    {failure}\n  2    usage error\n"
        f"  130  interrupted (Ctrl-C); running the command again finishes the job\n\n"
        f"{_USAGE_AND_JSON}"
    )


# What the exit-code table of each command adds (docs/operations.md, "Command reference").
_USAGE_AND_JSON = (
    "2 is an unknown, missing or contradicting option, or a tier URL that no installed backend\n"
    "serves: a mistyped one (s3:/bucket/run), an unknown scheme, a plugin not installed.\n"
    "With --json, an error is one line of JSON on stderr (stdout holds results only):\n"
    '{"error": TYPE, "message": ..., "exit_code": N, "command": ...}, with "tier",\n'
    '"checkpoint" and "file" where the error names them.'
)


def _version() -> str:
    try:
        return version("tierstore")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hot", metavar="PATH|URL", help="hot tier: a local path or a URL")
    p.add_argument("--cold", metavar="URL", help="cold tier: s3://, gs://, fsspec+... or a local path")
    p.add_argument(
        "--hot-option",
        action="append",
        metavar="KEY=VALUE",
        help="hot backend option, repeatable (VALUE parsed as JSON when it is)",
    )
    p.add_argument(
        "--cold-option",
        action="append",
        metavar="KEY=VALUE",
        help="cold backend option, repeatable, e.g. endpoint_url=http://minio:9000",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output on stdout, no progress; an error is one line of JSON on stderr",
    )


def _pick_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--step", type=int, help=f"the newest {what}checkpoint of this step")
    p.add_argument("--name", help=f"the {what}checkpoint of this name (as `ls` shows it)")


def _transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=2, help="files copied at once (default 2)")
    p.add_argument("--bandwidth", type=float, metavar="MIB_S", help="cap the copy at this many MiB/s")


def _cold_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cold-wait",
        type=float,
        default=COLD_WAIT,
        metavar="SECONDS",
        help=f"wait this long for the cold tier before reporting it unreachable (default {COLD_WAIT:g})",
    )


def _best(text: str) -> keep_best:
    """``--*-keep-best METRIC:K[:min|max]``; a bad one is a usage error."""
    metric, _, rest = text.partition(":")
    k, _, mode = rest.partition(":")
    if not (k.isdigit() and mode in ("", "min", "max")):
        raise argparse.ArgumentTypeError(f"{text!r} is not METRIC:K[:min|max], e.g. val_loss:3:min")
    try:
        return keep_best(metric, int(k), "max" if mode == "max" else "min")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# The retention flags, one per policy and tier: (rule, type, metavar, help with {tier}).
_KEEP_FLAGS: tuple[tuple[str, Any, str, str], ...] = (
    ("last", int, "N", "keep the newest N checkpoints in the {tier} tier"),
    ("every", int, "K", "keep every checkpoint whose step is a multiple of K in the {tier} tier"),
    ("within", float, "SECONDS", "keep the {tier} tier's checkpoints saved in the last SECONDS"),
    (
        "best",
        _best,
        "METRIC:K[:min|max]",
        "keep the {tier} tier's K best checkpoints by a metric their saves recorded (lowest "
        "with min, the default; highest with max)",
    ),
)


def _prune_args(p: argparse.ArgumentParser) -> None:
    for tier in ("hot", "cold"):
        for rule, kind, metavar, text in _KEEP_FLAGS:
            p.add_argument(f"--{tier}-keep-{rule}", type=kind, metavar=metavar, help=text.format(tier=tier))
    p.add_argument("--yes", action="store_true", help="really prune (default: a dry run)")


def _gc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        metavar="SECONDS",
        help="only collect objects older than this (default: a day)",
    )
    p.add_argument("--yes", action="store_true", help="really delete (default: a dry run)")


def _verify_resume_args(p: argparse.ArgumentParser) -> None:
    _pick_args(p, "")
    p.add_argument(
        "--probe",
        required=True,
        metavar="MODULE:FUNCTION",
        help="probe function, 'package.module:function' or 'path/to/file.py:function'",
    )
    p.add_argument(
        "--nproc", type=int, help="fresh processes (default: the record's, else the checkpoint's world size)"
    )
    p.add_argument(
        "--record", metavar="DIR", help="live record written by verify_resume(..., record_dir=DIR)"
    )
    p.add_argument("--rtol", type=float, default=0.0, help="relative loss tolerance (default bit-exact)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute loss tolerance (default bit-exact)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="seconds for the fresh processes (default 600)",
    )


def _only_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="only this checkpoint (as `ls` shows it)")


def _migrate_args(p: argparse.ArgumentParser) -> None:
    _transfer_args(p)
    _only_name(p)


def _restore_args(p: argparse.ArgumentParser) -> None:
    _transfer_args(p)
    _pick_args(p, "cold ")


def _quarantine_args(p: argparse.ArgumentParser) -> None:
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--delete",
        metavar="NAME",
        help="remove this quarantined checkpoint's data and record (a dry run unless --yes); "
        "refused, deleting nothing, while the recorded attempt is the one committed",
    )
    act.add_argument(
        "--restore",
        metavar="NAME",
        help="publish it again (the damage was not real); finishes an interrupted restore; "
        "refused if another attempt took the name, or the data is no longer whole",
    )
    p.add_argument("--attempt", help="only this attempt of NAME (as the list shows it)")
    p.add_argument("--yes", action="store_true", help="really delete (with --delete)")


# cp: tierstore.cli.copy
def _cp_args(p: argparse.ArgumentParser) -> None:
    _transfer_args(p)
    pick = p.add_mutually_exclusive_group(required=True)
    pick.add_argument("--step", type=int, help="the newest checkpoint of this step")
    pick.add_argument("--name", help="the checkpoint of this name (as `ls` shows it)")
    p.add_argument(
        "--to",
        required=True,
        metavar="PATH|URL",
        help="destination tier: a local path, file://, s3://, gs:// or fsspec+...; "
        "`tierstore ls --hot URL` lists it afterwards",
    )
    p.add_argument(
        "--to-option",
        action="append",
        metavar="KEY=VALUE",
        help="destination backend option, repeatable (VALUE parsed as JSON when it is)",
    )


def _size(text: str) -> int:
    """``--max-shard-size``: bytes, or with a unit (``5GB``, ``500MB``, ``2GiB``)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    number = text.strip().upper().rstrip("BITKMG") or "x"
    unit = text.strip().upper()[len(number) :]
    if not number.isdigit() or unit not in units or int(number) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size, e.g. 5GB, 500MB or 2000000000")
    return int(number) * units[unit]


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=int, help="the newest checkpoint of this step (default: the newest of all)")
    p.add_argument("--name", help="the checkpoint of this name, as `ls` shows it (default: the newest)")
    p.add_argument(
        "--format",
        required=True,
        choices=("safetensors", "torch", "dcp"),
        help="safetensors: Hugging Face shards and model.safetensors.index.json, tensors only; "
        "torch: one torch.save file, state_dict.pt; dcp: a plain DCP checkpoint "
        "(dcp.FileSystemReader reads it)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="a new or empty local directory, outside every tier (never a tier's directory, "
        "one inside a tier or one above a tier)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--strip-prefix",
        metavar="P",
        help="only keys under P, with P taken off (e.g. train.model.); the others are left out and "
        "counted (safetensors and torch; safetensors without it: the model's weights, their "
        "prefix found from the keys and named in the output)",
    )
    which.add_argument(
        "--all",
        action="store_true",
        dest="all_keys",
        help="safetensors: every tensor of the checkpoint, optimizer state included, by its full key",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "float64"),
        help="cast the floating tensors to this dtype (safetensors and torch)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a Hugging Face config.json to copy into --out (checked to be a JSON object), so "
        "that from_pretrained(DIR) loads it as it is (safetensors)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default=5 * 10**9,
        metavar="SIZE",
        help="the most bytes of tensors per safetensors shard, e.g. 500MB (default 5GB)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty --out and everything in it (never the current or home "
        "directory, one above either, or a directory holding any tierstore tier)",
    )


# du: tierstore.cli.usage
def _du_args(p: argparse.ArgumentParser) -> None:
    _cold_wait(p)


_EXTRA: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "ls": _cold_wait,
    "show": lambda p: _pick_args(p, ""),
    "migrate": _migrate_args,
    "restore": _restore_args,
    "status": _cold_wait,
    "verify": _only_name,
    "gc": _gc_args,
    "prune": _prune_args,
    "quarantine": _quarantine_args,
    "verify-resume": _verify_resume_args,
    "cp": _cp_args,
    "export": _export_args,
    "du": _du_args,
}


def build_parser(commands: Mapping[str, Command]) -> argparse.ArgumentParser:
    """The parser of ``tierstore``; ``commands`` maps each subcommand to its function."""
    parser = _Parser(
        prog="tierstore",
        description="Inspect and operate a tierstore store.",
        epilog="exit codes: 0 success, 1 failure or damage found, 2 usage error (an option, or a "
        "tier URL no\ninstalled backend serves), 130 interrupted; with --json, an error is one "
        "line of JSON on stderr.\n"
        "`tierstore COMMAND --help` shows each command's options, an example and its exit codes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (about, _, _) in _ABOUT.items():
        p = sub.add_parser(
            name,
            help=about,
            description=_LONG.get(name, about[0].upper() + about[1:] + "."),
            epilog=_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _store_args(p)
        _EXTRA[name](p)
        p.set_defaults(func=commands[name])
    return parser
