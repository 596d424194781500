"""``tierstore export``: a committed checkpoint written out for inference or sharing
(:func:`tierstore.dcp.export.export`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from tierstore._redact import redact_url
from tierstore.cli.common import require_picked, store_of
from tierstore.cli.parser import EXIT_OK, UsageError
from tierstore.errors import ConfigError
from tierstore.progress import size_text
from tierstore.tiers.roots import refuse_overlap

if TYPE_CHECKING:
    from tierstore.dcp.export import ExportReport

__all__ = ["cmd_export"]

_SHOWN = 5  # left-out keys named one by one before "and N more"


def _keys_text(keys: tuple[str, ...]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _only_safetensors(args: argparse.Namespace) -> None:
    if args.all_keys:
        raise UsageError(
            f"--all is for --format safetensors: a {args.format} export keeps every key "
            "unless given --strip-prefix"
        )
    if args.config is not None:
        raise UsageError("--config is for --format safetensors: the directory from_pretrained loads")
    if args.dtype is not None and args.format == "dcp":
        raise UsageError(
            "--dtype is for --format safetensors or torch: a dcp export keeps the checkpoint as it is"
        )


def _print_selection(args: argparse.Namespace, report: ExportReport) -> None:
    """Which keys were exported, and what was left out, in words."""
    if report.format == "safetensors" and args.strip_prefix is None and not args.all_keys:
        if report.prefix is None:
            print("no model's prefix among the keys: exported every tensor (--strip-prefix P picks some)")
        else:
            print(
                f"exported the model's weights, under {report.prefix} (found from the keys; "
                "--strip-prefix P picks another, --all exports every tensor)"
            )
    if report.skipped:
        print(f"skipped {len(report.skipped)} entries that are not tensors: {_keys_text(report.skipped)}")
    if report.outside_prefix:
        print(
            f"left out {len(report.outside_prefix)} keys not under {report.prefix}: "
            f"{_keys_text(report.outside_prefix)}"
        )
    for second, first in report.tied:
        print(f"left out {second}: tied to {first} (from_pretrained ties it again)")
    if report.dtype is not None:
        print(f"cast floating tensors to {report.dtype}")


def cmd_export(args: argparse.Namespace) -> int:
    if "://" in args.out:
        raise UsageError(f"--out must be a local directory, not {redact_url(args.out)}: export, then copy it")
    if args.strip_prefix is not None and args.format == "dcp":
        raise UsageError("--strip-prefix is for --format safetensors or torch: a dcp export keeps every key")
    if args.format != "safetensors":
        _only_safetensors(args)
    if args.config is not None:
        from tierstore.dcp.export import read_config

        try:  # before anything is read: a usage error (exit 2)
            read_config(args.config)
        except ConfigError as err:
            raise UsageError(str(err)) from None
    store = store_of(args)
    try:  # --out against --hot and --cold: nothing read yet, a usage error (exit 2)
        refuse_overlap(args.out, store.tiers, what="--out")
    except ConfigError as err:
        raise UsageError(str(err)) from None
    require_picked(args, store.tiers)
    from tierstore.dcp.export import export  # imports torch, and safetensors when asked

    report = export(
        store,
        name=args.name,
        step=args.step,
        format=args.format,
        out=args.out,
        strip_prefix=args.strip_prefix,
        all_keys=args.all_keys,
        dtype=args.dtype,
        config=args.config,
        max_shard_size=args.max_shard_size,
        force=args.force,
        progress=args.progress,
    )
    args.progress.close()
    if args.json:
        print(json.dumps(asdict(report), indent=1))
        return EXIT_OK
    _print_selection(args, report)
    print(
        f"exported {report.name} (step {report.step}) as {report.format} into {report.out}: "
        f"{report.keys} entries, {size_text(report.bytes)} of tensors, {len(report.files)} files"
    )
    return EXIT_OK
