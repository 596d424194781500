"""The commands that look at a store: ``ls``, ``show``, ``status``, ``verify``, ``quarantine``."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from tierstore.cli.checks import cold_unreachable
from tierstore.cli.common import (
    age_text,
    metrics_text,
    print_quarantined,
    quarantine_rows,
    require_picked,
    run_text,
    say_unreachable,
    status_json,
    store_of,
    structure_text,
)
from tierstore.cli.parser import EXIT_ERROR, EXIT_OK
from tierstore.errors import CheckpointNotFound, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.quarantine import delete_quarantined, restore_quarantined
from tierstore.lifecycle.scrub import verify_store
from tierstore.migration.migrator import MigrationState
from tierstore.migration.status import migration_status
from tierstore.progress import size_text
from tierstore.redundancy.records import describe_copies
from tierstore.tiers.catalog import list_checkpoints, resolve
from tierstore.tiers.tier import Store, Tier


def cmd_ls(args: argparse.Namespace) -> int:
    store = store_of(args)
    down = cold_unreachable(store.cold, args.cold_wait)
    if down is not None:
        store = Store.of_tiers(store.hot, None)
    infos = list_checkpoints(store)
    states: dict[str, str] = {}
    if store.hot and store.cold:
        states = {s.name: s.state.value for s in migration_status(store)}
    now = time.time()
    unknown = "unknown" if down else "-"
    rows = [
        {
            **asdict(i),
            "age_seconds": now - i.created,
            "migration": states.get(i.name, "committed" if "cold" in i.tiers else unknown),
        }
        for i in infos
    ]
    aside = quarantine_rows(store)
    if args.json:
        print(json.dumps([*rows, *({**q, "quarantined": True} for q in aside)], indent=1))
    elif not infos:
        print("no committed checkpoints")
    else:
        measured = any(i.metrics for i in infos)  # the column only when a save recorded some
        # Likewise the run (a name, or the job that saved) and the structure's fingerprint.
        runs = [run_text(i.run, i.job) for i in infos] if any(i.run or i.job for i in infos) else []
        run_width = max((len(r) for r in runs), default=0) + 2
        shaped = any(i.fingerprint for i in infos)
        print(
            f"{'name':<24}{'step':>10}{'size':>12}{'files':>7}{'age':>10}  {'tiers':<10}"
            + (f"{'run':<{run_width}}" if runs else "")
            + (f"{'structure':<11}" if shaped else "")
            + (f"{'migration':<12}metrics" if measured else "migration")
        )
        for n, (i, row) in enumerate(zip(infos, rows)):
            step = "-" if i.step is None else str(i.step)
            age = age_text(row["age_seconds"])
            print(
                f"{i.name:<24}{step:>10}{size_text(i.size):>12}{i.num_files:>7}{age:>10}  "
                f"{','.join(i.tiers):<10}"
                + (f"{runs[n]:<{run_width}}" if runs else "")
                + (f"{structure_text(i.fingerprint):<11}" if shaped else "")
                + (
                    f"{row['migration']:<12}{metrics_text(i.metrics)}".rstrip()
                    if measured
                    else row["migration"]
                )
            )
    if not args.json:
        print_quarantined(aside)
    if down is not None:
        say_unreachable(args, down)
        return EXIT_ERROR
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    store = store_of(args)
    _named_for_verify(store, args.name)
    checks = verify_store(store, names=[args.name] if args.name else None, progress=args.progress)
    args.progress.close()
    bad = [c for c in checks if not c.ok]
    # A checkpoint a prune (of a job running beside) un-published while it was read: its
    # missing files are not damage (lifecycle.scrub).
    pruned = [c for c in checks if c.pruned]
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for tier, name in dict.fromkeys((c.tier, c.checkpoint) for c in pruned):
            print(f"PRUNED   {tier}  {name}: un-published while verify read it; not checked, not damage")
        for c in bad:
            print(f"DAMAGED  {c.tier}  {c.checkpoint}  {c.file}: {c.problem}")
        checked = len(checks) - len(pruned)
        print(
            f"verified {checked} files: {checked - len(bad)} ok, {len(bad)} damaged"
            + (f"; {len(pruned)} files of pruned checkpoints not checked" if pruned else "")
        )
    return EXIT_ERROR if bad else EXIT_OK


def _named_for_verify(store: Store, name: str | None) -> None:
    """:func:`require_named`, where a tier holding an invalid manifest of ``name`` holds it: verify
    reports that manifest (and checks another tier's copy) rather than stop at it."""
    from tierstore.errors import InvalidManifest  # verify's alone

    def holds(tier: Tier, name: str) -> bool:
        try:
            return tier.find_manifest(name) is not None
        except InvalidManifest:
            return True

    if name is not None and not any(holds(t, name) for t in store.tiers):
        raise CheckpointNotFound("no committed checkpoint of that name", checkpoint=name, tier=store.label)


def cmd_show(args: argparse.Namespace) -> int:
    tiers = store_of(args).tiers
    require_picked(args, tiers)
    manifest, holders = resolve(tiers, step=args.step, name=args.name)
    if args.json:
        body = json.loads(manifest.to_json())
        body.setdefault("files", [f.to_dict() for f in manifest.files])  # a root lists parts only
        body.setdefault("metrics", {})  # as `ls --json` has it
        for key in ("run", "job", "fingerprint"):
            body.setdefault(key, None)
        body["tiers"] = [t.role for t in holders]
        print(json.dumps(body, indent=1))
        return EXIT_OK
    _print_manifest(manifest, holders)
    return EXIT_OK


def _print_manifest(manifest: Manifest, holders: list[Tier]) -> None:
    print(f"checkpoint {manifest.name}  step {manifest.step}  attempt {manifest.attempt}")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    print(
        f"world size {manifest.world_size}  created {created}"
        f"  size {size_text(manifest.total_size)}  in {', '.join(t.label for t in holders)}"
    )
    if manifest.metrics:
        print(f"metrics: {metrics_text(manifest.metrics)}")
    job = f"  job: {manifest.job}" if manifest.job is not None else ""
    if manifest.run is not None:
        print(f"run: {manifest.run} (named){job}")
    else:
        print(f"run: none named{job}" if job else "run: none recorded")
    print(f"structure: {manifest.fingerprint or 'not recorded'}")
    print(f"data: {layout.attempt_prefix(manifest.name, manifest.attempt)}")
    for f in manifest.files:
        print(f"  rank {f.rank:>4}  {f.path:<24}{size_text(f.size):>12}  crc32c {f.crc32c:08x}")


def cmd_status(args: argparse.Namespace) -> int:
    store = store_of(args)
    down = cold_unreachable(store.cold, args.cold_wait)
    if down is not None:
        return _status_cold_down(args, store, down)
    statuses = migration_status(store)
    failed = any(s.state is MigrationState.FAILED for s in statuses)
    copies = _copies_rows(store)
    if args.json:
        print(json.dumps([_with_copies(status_json(s), copies) for s in statuses], indent=1))
        return EXIT_ERROR if failed else EXIT_OK
    print(f"{'name':<24}{'state':<11}{'uploaded':>22}{'lag':>10}  error")
    for s in statuses:
        moved = f"{size_text(s.bytes_done)}/{size_text(s.bytes_total)}"
        print(f"{s.name:<24}{s.state.value:<11}{moved:>22}{s.lag_seconds:>9.0f}s  {s.error or ''}")
    _print_copies(copies)
    print_quarantined(quarantine_rows(store))
    return EXIT_ERROR if failed else EXIT_OK  # a failed migration is damage to act on


def _unknown_row(info: Any) -> dict[str, Any]:
    return {"name": info.name, "step": info.step, "state": "unknown", "bytes_total": info.size}


def _copies_rows(store: Store) -> dict[str, dict[str, Any]]:
    """The copies this node's hot root keeps (``ManagerOptions(redundancy=)``), by checkpoint name."""
    if store.hot is None:
        return {}
    try:
        return {row["name"]: row for row in describe_copies(store.hot)}
    except TierstoreError as err:
        print(f"(cannot read this node's copies: {err})")
        return {}


def _with_copies(row: dict[str, Any], copies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    found = copies.get(row["name"])
    return {**row, "copies": found} if found else row


def _print_copies(copies: dict[str, dict[str, Any]]) -> None:
    """Where each rank's files are kept, for the checkpoints this node's copies protect."""
    if not copies:
        return
    print("\nprotected by copies on other nodes (this node's record: rank -> nodes holding its files)")
    for row in copies.values():
        holders = ", ".join(f"{rank}:{'+'.join(map(str, nodes))}" for rank, nodes in row["holders"].items())
        print(f"  {row['name']:<24}{row['scheme'] or '?':<22}{row['copies'] or '?'} copies  {holders}")


def _status_cold_down(args: argparse.Namespace, store: Store, why: str) -> int:
    """The hot checkpoints, each of unknown migration state."""
    infos = list_checkpoints(Store.of_tiers(store.hot, None))
    copies = _copies_rows(store)
    if args.json:
        print(
            json.dumps(
                [
                    _with_copies(
                        {"name": i.name, "step": i.step, "state": "unknown", "bytes_total": i.size}, copies
                    )
                    for i in infos
                ],
                indent=1,
            )
        )
    else:
        print(f"{'name':<24}{'state':<11}{'size':>22}")
        for i in infos:
            print(f"{i.name:<24}{'unknown':<11}{size_text(i.size):>22}")
        _print_copies(copies)
    say_unreachable(args, why)
    return EXIT_ERROR


def cmd_quarantine(args: argparse.Namespace) -> int:
    store = store_of(args)
    if args.delete is None and args.restore is None:
        rows = quarantine_rows(store)
        if args.json:
            print(json.dumps(rows, indent=1))
        elif not rows:
            print("no quarantined checkpoints")
        else:
            print(f"{'name':<24}{'step':>10}{'size':>12}  {'attempt':<30}{'tier':<8}reason")
            for row in rows:
                step = "-" if row["step"] is None else str(row["step"])
                print(
                    f"{row['name']:<24}{step:>10}{size_text(row['size']):>12}  {row['attempt']:<30}"
                    f"{row['tier'].split()[0]:<8}{row['reason']}"
                )
        return EXIT_OK
    if args.restore is not None:
        done = restore_quarantined(store, args.restore, args.attempt)
        for q in done:
            print(f"restored  {q.name}  {q.attempt}  {q.tier}")
        return EXIT_OK
    done = delete_quarantined(store, args.delete, args.attempt, dry_run=not args.yes)
    verb = "deleted" if args.yes else "would delete"
    for q in done:
        print(f"{verb}  {q.name}  {q.attempt}  {size_text(q.size)}  {q.tier}")
    if not args.yes:
        print("(dry run: pass --yes to delete)")
    return EXIT_OK
