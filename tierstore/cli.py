"""The ``tierstore`` command: inspect and operate a store (``python -m tierstore`` too).

Exit codes: 0 success; 1 the operation failed, found damage (``verify``, ``gc``), left
something unmigrated (``migrate``, ``status``), a tier path does not exist, or the cold tier
could not be reached; 2 bad usage; 130 interrupted (Ctrl-C). The options, help texts and
examples are in :mod:`tierstore._cli_parser`; docs/operations.md, "Command reference", lists
them too.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from tierstore._cli_checks import CommandFailed, cold_unreachable, require_tiers
from tierstore._cli_parser import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, build_parser
from tierstore._redact import redact_url
from tierstore.errors import CheckpointNotFound, TierstoreError
from tierstore.format import layout
from tierstore.format.manifest import Manifest
from tierstore.lifecycle.gc import collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.quarantine import delete_quarantined, list_quarantined, restore_quarantined
from tierstore.lifecycle.retention import Policy, keep_all, keep_every, keep_last, keep_within
from tierstore.lifecycle.scrub import verify_store
from tierstore.progress import ProgressDisplay, size_text
from tierstore.tiers.catalog import list_checkpoints, resolve
from tierstore.tiers.migrator import MigrationConfig, MigrationState
from tierstore.tiers.restore import restore_checkpoint
from tierstore.tiers.status import migrate_pending, migration_status
from tierstore.tiers.tier import Store, Tier

__all__ = ["main"]

# The tier a command creates when it is missing (tierstore._cli_checks.require_tiers).
_CREATES = {"migrate": "cold", "restore": "hot"}


def _store(args: argparse.Namespace) -> Store:
    return Store.of(args.hot, args.cold, hot_options=_options(args.hot_option),
                    cold_options=_options(args.cold_option))


def _options(pairs: list[str] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)  # numbers, booleans, lists
        except json.JSONDecodeError:
            options[key] = value
    return options


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} d"


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{name}={value:.6g}" for name, value in sorted(metrics.items()))


def _say_unreachable(args: argparse.Namespace, why: str) -> None:
    print(f"tierstore {args.command}: the cold tier {redact_url(args.cold)} is unreachable "
          f"({why}); showing the hot tier only", file=sys.stderr)


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    down = cold_unreachable(store.cold, args.cold_wait)
    if down is not None:
        store = Store.of_tiers(store.hot, None)
    infos = list_checkpoints(store)
    states: dict[str, str] = {}
    if store.hot and store.cold:
        states = {s.name: s.state.value for s in migration_status(store)}
    now = time.time()
    unknown = "unknown" if down else "-"
    rows = [{**asdict(i), "age_seconds": now - i.created,
             "migration": states.get(i.name, "committed" if "cold" in i.tiers else unknown)} for i in infos]
    aside = _quarantine_rows(store)
    if args.json:
        print(json.dumps([*rows, *({**q, "quarantined": True} for q in aside)], indent=1))
    elif not infos:
        print("no committed checkpoints")
    else:
        measured = any(i.metrics for i in infos)  # the column only when a save recorded some
        print(f"{'name':<24}{'step':>10}{'size':>12}{'files':>7}{'age':>10}  {'tiers':<10}"
              + (f"{'migration':<12}metrics" if measured else "migration"))
        for i, row in zip(infos, rows):
            step = "-" if i.step is None else str(i.step)
            age = _age(row["age_seconds"])
            print(f"{i.name:<24}{step:>10}{_human(i.size):>12}{i.num_files:>7}{age:>10}  "
                  f"{','.join(i.tiers):<10}"
                  + (f"{row['migration']:<12}{_metrics_text(i.metrics)}".rstrip() if measured
                     else row["migration"]))
    if not args.json:
        _print_quarantined(aside)
    if down is not None:
        _say_unreachable(args, down)
        return EXIT_ERROR
    return EXIT_OK


def _named(store: Store, name: str | None) -> None:
    """Refuse a ``--name`` that no tier of ``store`` commits."""
    if name is not None and not any(t.find_manifest(name) for t in store.tiers):
        raise CheckpointNotFound("no committed checkpoint of that name", checkpoint=name, tier=store.label)


def _picked(args: argparse.Namespace, tiers: list[Tier]) -> None:
    """Refuse ``--step`` and ``--name`` naming different checkpoints (a usage error)."""
    if args.name is None or args.step is None:
        return
    manifest, _ = resolve(tiers, name=args.name)
    if manifest.step != args.step:
        raise UsageError(f"--step {args.step} and --name {args.name} contradict each other: "
                         f"{args.name} is step {manifest.step}")


def cmd_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    _named_for_verify(store, args.name)
    checks = verify_store(store, names=[args.name] if args.name else None, progress=args.progress)
    args.progress.close()
    bad = [c for c in checks if not c.ok]
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in bad:
            print(f"DAMAGED  {c.tier}  {c.checkpoint}  {c.file}: {c.problem}")
        print(f"verified {len(checks)} files: {len(checks) - len(bad)} ok, {len(bad)} damaged")
    return EXIT_ERROR if bad else EXIT_OK


def _named_for_verify(store: Store, name: str | None) -> None:
    """:func:`_named`, where a tier holding an invalid manifest of ``name`` holds it: verify
    reports that manifest (and checks another tier's copy) rather than stop at it."""
    from tierstore.errors import InvalidManifest, ObjectTooLarge  # verify's alone

    def holds(tier: Tier, name: str) -> bool:
        try:
            return tier.find_manifest(name) is not None
        except (InvalidManifest, ObjectTooLarge):
            return True

    if name is not None and not any(holds(t, name) for t in store.tiers):
        raise CheckpointNotFound("no committed checkpoint of that name", checkpoint=name, tier=store.label)


def cmd_gc(args: argparse.Namespace) -> int:
    report = collect_garbage(_store(args), grace=args.grace, dry_run=not args.yes)
    code = EXIT_ERROR if report.failures or report.damaged else EXIT_OK
    if args.json:
        print(json.dumps({"deleted": report.deleted, "bytes": report.bytes,
                          "garbage": [asdict(g) for g in report.garbage],
                          "aborted_uploads": list(report.aborted_uploads),
                          "damaged": [asdict(d) for d in report.damaged],
                          "failures": [asdict(f) for f in report.failures]}, indent=1))
        return code
    verb = "deleted" if report.deleted else "would delete"
    for g in report.garbage:
        print(f"{verb}  {g.tier}  {g.key}  ({_human(g.size)}): {g.reason}")
    for upload in report.aborted_uploads:
        print(f"{'aborted' if report.deleted else 'would abort'}  incomplete upload {upload}")
    for d in report.damaged:
        print(f"DAMAGED  {d.tier}  {d.key}: {d.error} (its checkpoint's data is kept)")
    for f in report.failures:
        print(f"FAILED  {f.tier}  {f.key or '(listing)'}: {f.error}")
    print(f"{verb} {len(report.garbage)} objects, {_human(report.bytes)}"
          + ("" if report.deleted else "  (dry run: add --yes to delete)"))
    return code


def _policy(args: argparse.Namespace, tier: str) -> Policy | None:
    makers: dict[str, Callable[[Any], Policy]] = {"last": keep_last, "every": keep_every,
                                                  "within": keep_within,
                                                  "best": lambda best: best}  # parsed whole
    parts: list[Policy] = [make(value) for kind, make in makers.items()
                           if (value := getattr(args, f"{tier}_keep_{kind}")) is not None]
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
    reports = prune(_store(args), hot_policy=hot_policy or keep_all(),
                    cold_policy=cold_policy or keep_all(), dry_run=not args.yes)
    # A checkpoint that could not be pruned is a failed operation (exit 1), as in gc.
    code = EXIT_ERROR if any(r.errors for r in reports) else EXIT_OK
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
        return code
    for r in reports:
        verb = "pruned" if not r.dry_run else "would prune"
        print(f"{r.tier}: {verb} {list(r.deleted) + list(r.deferred)} ({_human(r.bytes_freed)}); "
              f"kept {list(r.kept)}" + (f"; kept by safety rules {list(r.protected)}" if r.protected else ""))
        for warning in r.warnings:
            print(f"WARNING  {r.tier}  {warning}")
        for error in r.errors:
            print(f"FAILED  {r.tier}  {error}")
    if reports and reports[0].dry_run:
        print("(dry run: add --yes to prune)")
    return code


def cmd_show(args: argparse.Namespace) -> int:
    tiers = _store(args).tiers
    _picked(args, tiers)
    manifest, holders = resolve(tiers, step=args.step, name=args.name)
    if args.json:
        body = json.loads(manifest.to_json())
        body.setdefault("files", [f.to_dict() for f in manifest.files])  # a root lists parts only
        body.setdefault("metrics", {})  # as `ls --json` has it
        body["tiers"] = [t.role for t in holders]
        print(json.dumps(body, indent=1))
        return EXIT_OK
    _print_manifest(manifest, holders)
    return EXIT_OK


def _print_manifest(manifest: Manifest, holders: list[Tier]) -> None:
    print(f"checkpoint {manifest.name}  step {manifest.step}  attempt {manifest.attempt}")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    print(f"world size {manifest.world_size}  created {created}"
          f"  size {_human(manifest.total_size)}  in {', '.join(t.label for t in holders)}")
    if manifest.metrics:
        print(f"metrics: {_metrics_text(manifest.metrics)}")
    print(f"data: {layout.attempt_prefix(manifest.name, manifest.attempt)}")
    for f in manifest.files:
        print(f"  rank {f.rank:>4}  {f.path:<24}{_human(f.size):>12}  crc32c {f.crc32c:08x}")


def _config(args: argparse.Namespace) -> MigrationConfig:
    bandwidth = args.bandwidth * 2**20 if args.bandwidth else None
    return MigrationConfig(concurrency=args.concurrency, bandwidth=bandwidth)


def cmd_migrate(args: argparse.Namespace) -> int:
    store = _store(args)
    if store.hot is not None and args.name is not None:
        _named(Store.of_tiers(store.hot, None), args.name)
    results = migrate_pending(store, names=[args.name] if args.name else None,
                              config=_config(args), progress=args.progress)
    args.progress.close()
    failed = [r for r in results if r.state is MigrationState.FAILED]
    if args.json:
        print(json.dumps([_status_json(r) for r in results], indent=1))
    else:
        for r in results:
            detail = f": rank {r.failed_rank}, file {r.failed_file}: {r.error}" if r.error else ""
            print(f"{r.name}: {r.state.value}{detail}")
        if not results:
            print("nothing to migrate: every hot checkpoint is committed in the cold tier")
    return EXIT_ERROR if failed else EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    store = _store(args)
    _picked(args, store.tiers[1:])
    report = restore_checkpoint(store, step=args.step, name=args.name,
                                config=_config(args), progress=args.progress)
    args.progress.close()
    manifest = report.manifest
    if args.json:
        print(json.dumps({"name": manifest.name, "step": manifest.step, "attempt": manifest.attempt,
                          "copied": list(report.copied),
                          "repaired": [asdict(r) for r in report.repaired],
                          "manifest_repaired": report.manifest_repaired}))
        return EXIT_OK
    for repair in report.repaired:
        print(f"repaired  {manifest.name}  {repair.path}: {repair.problem}")
    if report.manifest_repaired:
        print(f"repaired  {manifest.name}  manifest: it was damaged in the hot tier")
    print(f"restored {manifest.name} (step {manifest.step}) into {redact_url(args.hot)}: "
          f"{len(report.copied)} files copied, {len(report.repaired)} repaired")
    return EXIT_OK


def _status_json(status: Any) -> dict[str, Any]:
    body = asdict(status)
    body["state"] = status.state.value
    body["lag_bytes"] = status.lag_bytes
    return body


def cmd_status(args: argparse.Namespace) -> int:
    store = _store(args)
    down = cold_unreachable(store.cold, args.cold_wait)
    if down is not None:
        return _status_cold_down(args, store, down)
    statuses = migration_status(store)
    failed = any(s.state is MigrationState.FAILED for s in statuses)
    if args.json:
        print(json.dumps([_status_json(s) for s in statuses], indent=1))
        return EXIT_ERROR if failed else EXIT_OK
    print(f"{'name':<24}{'state':<11}{'uploaded':>22}{'lag':>10}  error")
    for s in statuses:
        moved = f"{_human(s.bytes_done)}/{_human(s.bytes_total)}"
        print(f"{s.name:<24}{s.state.value:<11}{moved:>22}{s.lag_seconds:>9.0f}s  {s.error or ''}")
    _print_quarantined(_quarantine_rows(store))
    return EXIT_ERROR if failed else EXIT_OK  # a failed migration is damage to act on


def _status_cold_down(args: argparse.Namespace, store: Store, why: str) -> int:
    """The hot checkpoints, each of unknown migration state."""
    infos = list_checkpoints(Store.of_tiers(store.hot, None))
    if args.json:
        print(json.dumps([{"name": i.name, "step": i.step, "state": "unknown", "bytes_total": i.size}
                          for i in infos], indent=1))
    else:
        print(f"{'name':<24}{'state':<11}{'size':>22}")
        for i in infos:
            print(f"{i.name:<24}{'unknown':<11}{_human(i.size):>22}")
    _say_unreachable(args, why)
    return EXIT_ERROR


def _quarantine_rows(store: Store) -> list[dict[str, Any]]:
    return [{"name": q.name, "attempt": q.attempt, "step": q.step, "tier": q.tier,
             "size": q.size, "reason": q.reason, "when": q.when} for q in list_quarantined(store)]


def _print_quarantined(rows: list[dict[str, Any]]) -> None:
    """The quarantined checkpoints under a listing (``ls``, ``status``), if there are any."""
    if not rows:
        return
    print(f"\nquarantined (found damaged by a resume, un-published, data kept; "
          f"`tierstore quarantine` to remove): {len(rows)}")
    for row in rows:
        step = "-" if row["step"] is None else str(row["step"])
        print(f"  {row['name']:<24}{step:>10}{_human(row['size']):>12}  {row['tier']}  {row['reason']}")


def cmd_quarantine(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.delete is None and args.restore is None:
        rows = _quarantine_rows(store)
        if args.json:
            print(json.dumps(rows, indent=1))
        elif not rows:
            print("no quarantined checkpoints")
        else:
            print(f"{'name':<24}{'step':>10}{'size':>12}  {'attempt':<30}{'tier':<8}reason")
            for row in rows:
                step = "-" if row["step"] is None else str(row["step"])
                print(f"{row['name']:<24}{step:>10}{_human(row['size']):>12}  {row['attempt']:<30}"
                      f"{row['tier'].split()[0]:<8}{row['reason']}")
        return EXIT_OK
    if args.restore is not None:
        done = restore_quarantined(store, args.restore, args.attempt)
        for q in done:
            print(f"restored  {q.name}  {q.attempt}  {q.tier}")
        return EXIT_OK
    done = delete_quarantined(store, args.delete, args.attempt, dry_run=not args.yes)
    verb = "deleted" if args.yes else "would delete"
    for q in done:
        print(f"{verb}  {q.name}  {q.attempt}  {_human(q.size)}  {q.tier}")
    if not args.yes:
        print("(dry run: pass --yes to delete)")
    return EXIT_OK


def cmd_verify_resume(args: argparse.Namespace) -> int:
    from tierstore.resume.check import verify_checkpoint  # imports torch only in the fresh processes

    store = _store(args)
    _picked(args, store.tiers)
    report = verify_checkpoint(args.probe, store, name=args.name, step=args.step,
                               nproc=args.nproc, record=args.record, rtol=args.rtol, atol=args.atol,
                               timeout=args.timeout)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_ERROR


COMMANDS = {"ls": cmd_ls, "show": cmd_show, "migrate": cmd_migrate, "restore": cmd_restore,
            "status": cmd_status, "verify": cmd_verify, "gc": cmd_gc, "prune": cmd_prune,
            "quarantine": cmd_quarantine, "verify-resume": cmd_verify_resume}

# What an interrupted command has done, and why running it again finishes the job: every
# object write is atomic and every manifest is published last (docs/design.md invariants 2
# and 12), so an interruption leaves nothing a rerun cannot complete.
_RESUME = {
    "migrate": ("uploaded {done} of {total}, {finished} checkpoint(s) copied in full",
                "run the same `tierstore migrate` again to finish; verified uploads are not sent again"),
    "restore": ("copied {done} of {total}",
                "run the same `tierstore restore` again to finish; verified files are not copied again"),
    "verify": ("read {done} of {total}, {finished} checkpoint copies verified in full",
               "nothing was changed; run `tierstore verify` again to check everything"),
    "gc": ("only garbage is deleted, in batches",
           "run the same `tierstore gc` again to finish"),
    "prune": ("a checkpoint is un-published before its data is deleted",
              "run the same `tierstore prune` again to finish; `tierstore gc` removes stray data"),
}


def _interrupted(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback
    progress: ProgressDisplay = args.progress
    progress.close()
    done, resume = _RESUME.get(args.command, ("stopped", "nothing was changed"))
    done = done.format(done=size_text(progress.bytes_done), total=size_text(progress.bytes_total),
                       finished=len(progress.finished))
    print(f"tierstore {args.command}: interrupted: {done}; {resume}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(COMMANDS).parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # Interrupted by Ctrl-C even where the shell started us with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args.progress = ProgressDisplay(show=not args.json)
    try:
        if args.hot is None and args.cold is None:
            raise UsageError("give --hot and/or --cold")
        if args.command in ("migrate", "restore", "status") and not (args.hot and args.cold):
            raise UsageError("--hot and --cold are both required")
        require_tiers({"hot": args.hot, "cold": args.cold}, _CREATES.get(args.command))
        return int(args.func(args))
    except UsageError as err:
        print(f"tierstore {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except CommandFailed as err:
        print(f"tierstore {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except TierstoreError as err:
        print(f"tierstore: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return _interrupted(args)


if __name__ == "__main__":
    sys.exit(main())
