"""The commands that change a store: ``migrate``, ``restore``, ``gc``, ``prune``, and
``verify-resume`` (which loads a checkpoint in fresh processes)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from tierstore._redact import redact_url
from tierstore.cli.common import (
    migration_config,
    require_named,
    require_picked,
    said_json,
    status_json,
    store_of,
)
from tierstore.cli.parser import EXIT_ERROR, EXIT_OK, UsageError
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import Policy, keep_all, keep_every, keep_last, keep_within
from tierstore.migration.migrator import MigrationState
from tierstore.migration.restore import restore_checkpoint
from tierstore.migration.status import migrate_pending
from tierstore.progress import size_text
from tierstore.tiers.tier import Store


def cmd_gc(args: argparse.Namespace) -> int:
    report = collect_garbage(store_of(args), grace=args.grace, dry_run=not args.yes)
    code = EXIT_ERROR if report.failures or report.damaged else EXIT_OK
    if args.json:
        print(
            json.dumps(
                {
                    "deleted": report.deleted,
                    "bytes": report.bytes,
                    "garbage": [asdict(g) for g in report.garbage],
                    "aborted_uploads": list(report.aborted_uploads),
                    "damaged": [asdict(d) for d in report.damaged],
                    "failures": [asdict(f) for f in report.failures],
                },
                indent=1,
            )
        )
        return code
    verb = "deleted" if report.deleted else "would delete"
    for g in report.garbage:
        print(f"{verb}  {g.tier}  {g.key}  ({size_text(g.size)}): {g.reason}")
    for upload in report.aborted_uploads:
        print(f"{'aborted' if report.deleted else 'would abort'}  incomplete upload {upload}")
    for d in report.damaged:
        print(f"DAMAGED  {d.tier}  {d.key}: {d.error} (its checkpoint's data is kept)")
    for f in report.failures:
        print(f"FAILED  {f.tier}  {f.key or '(listing)'}: {f.error}")
    print(
        f"{verb} {len(report.garbage)} objects, {size_text(report.bytes)}"
        + ("" if report.deleted else "  (dry run: add --yes to delete)")
    )
    return code


def _policy(args: argparse.Namespace, tier: str) -> Policy | None:
    makers: dict[str, Callable[[Any], Policy]] = {
        "last": keep_last,
        "every": keep_every,
        "within": keep_within,
        "best": lambda best: best,
    }  # parsed whole
    parts: list[Policy] = [
        make(value)
        for kind, make in makers.items()
        if (value := getattr(args, f"{tier}_keep_{kind}")) is not None
    ]
    if not parts:
        return None
    policy = parts[0]
    for part in parts[1:]:
        policy = policy | part
    return policy


def cmd_prune(args: argparse.Namespace) -> int:
    hot_policy, cold_policy = _policy(args, "hot"), _policy(args, "cold")
    if hot_policy is None and cold_policy is None:
        raise UsageError("give a policy, e.g. --hot-keep-last 2 --cold-keep-last 3")
    reports = prune(
        store_of(args),
        hot_policy=hot_policy or keep_all(),
        cold_policy=cold_policy or keep_all(),
        dry_run=not args.yes,
    )
    # A checkpoint that could not be pruned is a failed operation (exit 1), as in gc.
    code = EXIT_ERROR if any(r.errors for r in reports) else EXIT_OK
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
        return code
    for r in reports:
        verb = "pruned" if not r.dry_run else "would prune"
        print(
            f"{r.tier}: {verb} {list(r.deleted) + list(r.deferred)} ({size_text(r.bytes_freed)}); "
            f"kept {list(r.kept)}" + (f"; kept by safety rules {list(r.protected)}" if r.protected else "")
        )
        for warning in r.warnings:
            print(f"WARNING  {r.tier}  {warning}")
        for error in r.errors:
            print(f"FAILED  {r.tier}  {error}")
    if reports and reports[0].dry_run:
        print("(dry run: add --yes to prune)")
    return code


def cmd_migrate(args: argparse.Namespace) -> int:
    store = store_of(args)
    if store.hot is not None and args.name is not None:
        require_named(Store.of_tiers(store.hot, None), args.name)
    args.committed = []  # what an interrupted migrate counts (tierstore.cli._interrupted)
    results = migrate_pending(
        store,
        names=[args.name] if args.name else None,
        config=migration_config(args),
        progress=args.progress,
        finished=lambda r: args.committed.append(r.name) if r.state is MigrationState.COMMITTED else None,
    )
    args.progress.close()
    failed = [r for r in results if r.state is MigrationState.FAILED]
    if args.json:
        print(json.dumps([status_json(r) for r in results], indent=1))
    else:
        for r in results:
            detail = f": rank {r.failed_rank}, file {r.failed_file}: {r.error}" if r.error else ""
            print(f"{r.name}: {r.state.value}{detail}")
        if not results:
            print("nothing to migrate: every hot checkpoint is committed in the cold tier")
    return EXIT_ERROR if failed else EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    store = store_of(args)
    require_picked(args, store.tiers[1:])
    args.committed = []  # published in the hot tier: only once restore_checkpoint returns
    report = restore_checkpoint(
        store, step=args.step, name=args.name, config=migration_config(args), progress=args.progress
    )
    args.committed.append(report.manifest.name)
    manifest = report.manifest
    if said_json(
        args,
        manifest,
        copied=list(report.copied),
        repaired=[asdict(r) for r in report.repaired],
        manifest_repaired=report.manifest_repaired,
    ):
        return EXIT_OK
    for repair in report.repaired:
        print(f"repaired  {manifest.name}  {repair.path}: {repair.problem}")
    if report.manifest_repaired:
        print(f"repaired  {manifest.name}  manifest: it was damaged in the hot tier")
    print(
        f"restored {manifest.name} (step {manifest.step}) into {redact_url(args.hot)}: "
        f"{len(report.copied)} files copied, {len(report.repaired)} repaired"
    )
    return EXIT_OK


def cmd_verify_resume(args: argparse.Namespace) -> int:
    from tierstore.resume.check import verify_checkpoint  # imports torch only in the fresh processes

    store = store_of(args)
    require_picked(args, store.tiers)
    report = verify_checkpoint(
        args.probe,
        store,
        name=args.name,
        step=args.step,
        nproc=args.nproc,
        record=args.record,
        rtol=args.rtol,
        atol=args.atol,
        timeout=args.timeout,
    )
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_ERROR
