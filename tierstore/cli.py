"""The ``tierstore`` command: inspect and operate a store (``python -m tierstore`` too).

Exit codes: 0 success; 1 the operation failed, or found damage (``verify``) or something it
could not migrate (``migrate``); 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from tierstore._redact import redact_url
from tierstore.commit import layout
from tierstore.errors import TierstoreError
from tierstore.lifecycle.gc import DEFAULT_GRACE, collect_garbage
from tierstore.lifecycle.prune import prune
from tierstore.lifecycle.retention import Policy, keep_all, keep_every, keep_last, keep_within
from tierstore.lifecycle.scrub import verify_store
from tierstore.tiers.catalog import list_checkpoints, resolve
from tierstore.tiers.migrator import MigrationConfig, MigrationState
from tierstore.tiers.restore import restore_checkpoint
from tierstore.tiers.status import migrate_pending, migration_status
from tierstore.tiers.tier import Store

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _store(args: argparse.Namespace) -> Store:
    return Store.of(args.hot, args.cold, hot_options=_options(args.hot_option),
                    cold_options=_options(args.cold_option))


def _options(pairs: Sequence[str] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"tierstore: option {pair!r} is not KEY=VALUE")
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


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    infos = list_checkpoints(store)
    states: dict[str, str] = {}
    if args.hot and args.cold:
        states = {s.name: s.state.value for s in
                  migration_status(store)}
    now = time.time()
    rows = [{**asdict(i), "age_seconds": now - i.created,
             "migration": states.get(i.name, "committed" if "cold" in i.tiers else "-")} for i in infos]
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not infos:
        print("no committed checkpoints")
        return EXIT_OK
    print(f"{'name':<24}{'step':>10}{'size':>12}{'files':>7}{'age':>10}  {'tiers':<10}migration")
    for i, row in zip(infos, rows):
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<24}{step:>10}{_human(i.size):>12}{i.num_files:>7}{_age(row['age_seconds']):>10}  "
              f"{','.join(i.tiers):<10}{row['migration']}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    names = [args.name] if args.name else None
    checks = verify_store(_store(args), names=names,
                          progress=None if args.json else Progress())
    bad = [c for c in checks if not c.ok]
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in bad:
            print(f"DAMAGED  {c.tier}  {c.checkpoint}  {c.file}: {c.problem}")
        print(f"verified {len(checks)} files: {len(checks) - len(bad)} ok, {len(bad)} damaged")
    return EXIT_ERROR if bad else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    report = collect_garbage(_store(args), grace=args.grace, dry_run=not args.yes)
    if args.json:
        print(json.dumps({"deleted": report.deleted, "bytes": report.bytes,
                          "garbage": [asdict(g) for g in report.garbage],
                          "aborted_uploads": list(report.aborted_uploads),
                          "damaged": [asdict(d) for d in report.damaged],
                          "failures": [asdict(f) for f in report.failures]}, indent=1))
        return EXIT_ERROR if report.failures or report.damaged else EXIT_OK
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
    return EXIT_ERROR if report.failures or report.damaged else EXIT_OK


def _policy(args: argparse.Namespace, tier: str) -> Policy | None:
    parts: list[Policy] = []
    last, every, within = (getattr(args, f"{tier}_keep_{k}") for k in ("last", "every", "within"))
    if last is not None:
        parts.append(keep_last(last))
    if every is not None:
        parts.append(keep_every(every))
    if within is not None:
        parts.append(keep_within(within))
    if not parts:
        return None
    policy = parts[0]
    for part in parts[1:]:
        policy = policy | part
    return policy


def cmd_prune(args: argparse.Namespace) -> int:
    hot_policy, cold_policy = _policy(args, "hot"), _policy(args, "cold")
    if hot_policy is None and cold_policy is None:
        raise SystemExit("tierstore prune: give a policy, e.g. --hot-keep-last 2 --cold-keep-last 3")
    reports = prune(_store(args), hot_policy=hot_policy or keep_all(),
                    cold_policy=cold_policy or keep_all(), dry_run=not args.yes)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
        return EXIT_OK
    for r in reports:
        verb = "pruned" if not r.dry_run else "would prune"
        print(f"{r.tier}: {verb} {list(r.deleted) + list(r.deferred)} ({_human(r.bytes_freed)}); "
              f"kept {list(r.kept)}" + (f"; kept by safety rules {list(r.protected)}" if r.protected else ""))
    if reports and reports[0].dry_run:
        print("(dry run: add --yes to prune)")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    manifest, holders = resolve(_store(args).tiers, step=args.step, name=args.name)
    if args.json:
        body = json.loads(manifest.to_json())
        body["tiers"] = [t.role for t in holders]
        print(json.dumps(body, indent=1))
        return EXIT_OK
    print(f"checkpoint {manifest.name}  step {manifest.step}  attempt {manifest.attempt}")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    print(f"world size {manifest.world_size}  created {created}"
          f"  size {_human(manifest.total_size)}  in {', '.join(t.label for t in holders)}")
    print(f"data: {layout.attempt_prefix(manifest.name, manifest.attempt)}")
    for f in manifest.files:
        print(f"  rank {f.rank:>4}  {f.path:<24}{_human(f.size):>12}  crc32c {f.crc32c:08x}")
    return EXIT_OK


class Progress:
    """A one-line progress display on stderr (a plain line per step when not a terminal)."""

    def __init__(self, stream: Any = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0

    def __call__(self, name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        line = f"{name}  [{bar:<30}] {frac:6.1%}  {_human(done)} / {_human(total)}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _config(args: argparse.Namespace) -> MigrationConfig:
    bandwidth = args.bandwidth * 2**20 if args.bandwidth else None
    return MigrationConfig(concurrency=args.concurrency, bandwidth=bandwidth)


def cmd_migrate(args: argparse.Namespace) -> int:
    if not args.cold:
        raise SystemExit("tierstore migrate: --cold is required")
    names = [args.name] if args.name else None
    results = migrate_pending(_store(args), names=names,
                              config=_config(args), progress=None if args.json else Progress())
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
    if not (args.hot and args.cold):
        raise SystemExit("tierstore restore: --hot and --cold are required")
    report = restore_checkpoint(_store(args), step=args.step, name=args.name,
                                config=_config(args), progress=None if args.json else Progress())
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
    if not (args.hot and args.cold):
        raise SystemExit("tierstore status: --hot and --cold are required")
    statuses = migration_status(_store(args))
    failed = any(s.state.value == "failed" for s in statuses)
    if args.json:
        print(json.dumps([_status_json(s) for s in statuses], indent=1))
        return EXIT_ERROR if failed else EXIT_OK
    print(f"{'name':<24}{'state':<11}{'uploaded':>22}{'lag':>10}  error")
    for s in statuses:
        moved = f"{_human(s.bytes_done)}/{_human(s.bytes_total)}"
        print(f"{s.name:<24}{s.state.value:<11}{moved:>22}{s.lag_seconds:>9.0f}s  {s.error or ''}")
    return EXIT_ERROR if failed else EXIT_OK  # a failed migration is damage to act on


def cmd_verify_resume(args: argparse.Namespace) -> int:
    from tierstore.resume.check import verify_checkpoint  # imports torch only in the fresh processes

    report = verify_checkpoint(args.probe, _store(args), name=args.name, step=args.step,
                               nproc=args.nproc, record=args.record, rtol=args.rtol, atol=args.atol,
                               timeout=args.timeout)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Inspect and operate a tierstore store.")
    sub = parser.add_subparsers(dest="command", required=True)

    def store_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hot", help="hot tier path or URL")
        p.add_argument("--cold", help="cold tier URL")
        p.add_argument("--hot-option", action="append", metavar="KEY=VALUE", help="hot backend option")
        p.add_argument("--cold-option", action="append", metavar="KEY=VALUE", help="cold backend option")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    def transfer_args(p: argparse.ArgumentParser) -> None:
        store_args(p)
        p.add_argument("--concurrency", type=int, default=2, help="files copied at once")
        p.add_argument("--bandwidth", type=float, help="cap in MiB/s")

    def command(name: str, about: str, func: Any, *, args: Any = store_args,
                pick: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=about)
        args(p)
        if pick:  # one checkpoint, by step or name
            p.add_argument("--step", type=int)
            p.add_argument("--name")
        p.set_defaults(func=func)
        return p

    command("ls", "list committed checkpoints", cmd_ls)
    command("show", "show a checkpoint's manifest", cmd_show, pick=True)
    migrate = command("migrate", "finish pending hot -> cold migrations", cmd_migrate, args=transfer_args)
    migrate.add_argument("--name", help="only this checkpoint")
    command("restore", "copy a cold checkpoint back to the hot tier", cmd_restore, args=transfer_args,
            pick=True)
    command("status", "migration state of every hot checkpoint", cmd_status)
    verify = command("verify", "re-read every file and check size and CRC32C", cmd_verify)
    verify.add_argument("--name", help="only this checkpoint")
    gc = sub.add_parser("gc", help="delete what no manifest names (dry run unless --yes)")
    store_args(gc)
    gc.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                    help="only collect objects older than this many seconds (default: a day)")
    gc.add_argument("--yes", action="store_true", help="really delete")
    gc.set_defaults(func=cmd_gc)
    prune_p = sub.add_parser("prune", help="apply retention policies (dry run unless --yes)")
    store_args(prune_p)
    for tier in ("hot", "cold"):
        prune_p.add_argument(f"--{tier}-keep-last", type=int, metavar="N")
        prune_p.add_argument(f"--{tier}-keep-every", type=int, metavar="K", help="milestone steps")
        prune_p.add_argument(f"--{tier}-keep-within", type=float, metavar="SECONDS")
    prune_p.add_argument("--yes", action="store_true", help="really prune")
    prune_p.set_defaults(func=cmd_prune)
    verify_resume = sub.add_parser(
        "verify-resume", help="load a checkpoint in fresh processes and check it restores the run",
        description="Load a checkpoint into fresh processes built by a probe and compare the loss on "
                    "a fixed batch and every state key with a live record (see docs/training-state.md).")
    store_args(verify_resume)
    verify_resume.add_argument("--probe", required=True, metavar="MODULE:FUNCTION",
                               help="probe function, 'package.module:function' or 'path/to/file.py:function'")
    verify_resume.add_argument("--step", type=int)
    verify_resume.add_argument("--name")
    verify_resume.add_argument("--nproc", type=int, help="fresh processes (default: the record's, "
                                                         "else the checkpoint's world size)")
    verify_resume.add_argument("--record", metavar="DIR",
                               help="live record written by verify_resume(..., record_dir=DIR)")
    verify_resume.add_argument("--rtol", type=float, default=0.0, help="loss tolerance (default bit-exact)")
    verify_resume.add_argument("--atol", type=float, default=0.0)
    verify_resume.add_argument("--timeout", type=float, default=600.0, help="seconds for the fresh processes")
    verify_resume.set_defaults(func=cmd_verify_resume)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.hot is None and args.cold is None:
        print("tierstore: give --hot and/or --cold", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except TierstoreError as err:
        print(f"tierstore: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
