"""``tierstore cp``: copy one committed checkpoint to another tier, verified
(:func:`tierstore.migration.copy.copy_checkpoint`)."""

from __future__ import annotations

import argparse

from tierstore._redact import redact_url
from tierstore.cli.common import migration_config, options_of, require_picked, said_json, store_of
from tierstore.cli.parser import EXIT_OK, UsageError
from tierstore.migration.copy import copy_checkpoint
from tierstore.progress import size_text
from tierstore.tiers.roots import local_path, overlap

__all__ = ["cmd_cp"]


def cmd_cp(args: argparse.Namespace) -> int:
    store = store_of(args)
    to = local_path(args.to)
    nested = None if to is None else overlap(to, store.tiers)
    if nested is not None and nested.how != "is":  # the same tier is fine: nothing to copy there
        raise UsageError(
            f"--to {nested}: a tier inside another mixes their objects (the outer tier's gc "
            "and du take the inner one's as its own); give a directory outside every tier"
        )
    require_picked(args, store.tiers)
    report = copy_checkpoint(
        store,
        args.to,
        name=args.name,
        step=args.step,
        destination_options=options_of(args.to_option),
        config=migration_config(args),
        progress=args.progress,
    )
    manifest = report.manifest
    if said_json(
        args,
        manifest,
        destination=redact_url(args.to),
        already_there=report.already_there,
        source=list(report.source),
        bytes_sent=report.bytes_sent,
        files_sent=report.files_sent,
        bytes_total=manifest.total_size,
        files_total=len(manifest.files),
    ):
        return EXIT_OK
    where = f"{manifest.name} (step {manifest.step}) in {redact_url(args.to)}"
    if report.already_there:
        print(f"already there: {where} is committed, the same attempt; nothing copied")
        return EXIT_OK
    resumed = (
        f"; {len(manifest.files) - report.files_sent} were already there, verified, and not sent again"
        if report.files_sent < len(manifest.files)
        else ""
    )
    print(
        f"copied {where} from {', '.join(report.source)}: {len(manifest.files)} files, "
        f"{size_text(manifest.total_size)}; sent {report.files_sent} files, "
        f"{size_text(report.bytes_sent)}{resumed}"
    )
    return EXIT_OK
