"""``tierstore export``: a committed checkpoint written out for inference or sharing
(:func:`tierstore.dcp.export.export`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from tierstore._redact import redact_url
from tierstore.cli.common import require_picked, store_of
from tierstore.cli.parser import EXIT_OK, UsageError
from tierstore.errors import ConfigError
from tierstore.progress import size_text
from tierstore.tiers.roots import refuse_overlap

__all__ = ["cmd_export"]

_SHOWN = 5  # left-out keys named one by one before "and N more"


def _keys_text(keys: tuple[str, ...]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def cmd_export(args: argparse.Namespace) -> int:
    if "://" in args.out:
        raise UsageError(f"--out must be a local directory, not {redact_url(args.out)}: export, then copy it")
    if args.strip_prefix is not None and args.format == "dcp":
        raise UsageError("--strip-prefix is for --format safetensors or torch: a dcp export keeps every key")
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
        max_shard_size=args.max_shard_size,
        force=args.force,
        progress=args.progress,
    )
    args.progress.close()
    if args.json:
        print(json.dumps(asdict(report), indent=1))
        return EXIT_OK
    if report.skipped:
        print(f"skipped {len(report.skipped)} entries that are not tensors: {_keys_text(report.skipped)}")
    if report.outside_prefix:
        print(
            f"left out {len(report.outside_prefix)} keys not under --strip-prefix "
            f"{args.strip_prefix}: {_keys_text(report.outside_prefix)}"
        )
    print(
        f"exported {report.name} (step {report.step}) as {report.format} into {report.out}: "
        f"{report.keys} entries, {size_text(report.bytes)} of tensors, {len(report.files)} files"
    )
    return EXIT_OK
