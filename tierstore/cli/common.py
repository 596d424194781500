"""What the commands share: the store the options name, and how values are shown (one
byte formatter, :func:`tierstore.progress.size_text`, for every size a command prints)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from tierstore._redact import redact_url
from tierstore.cli.parser import EXIT_ERROR, UsageError
from tierstore.errors import CheckpointNotFound
from tierstore.lifecycle.quarantine import list_quarantined
from tierstore.migration.migrator import MigrationOptions
from tierstore.progress import size_text
from tierstore.tiers.catalog import resolve
from tierstore.tiers.tier import Store, Tier

__all__ = [
    "store_of",
    "options_of",
    "age_text",
    "metrics_text",
    "run_text",
    "structure_text",
    "say_error",
    "say_unreachable",
    "require_named",
    "require_picked",
    "quarantine_rows",
    "print_quarantined",
    "status_json",
    "migration_config",
    "said_json",
    "size_text",
]


def store_of(args: argparse.Namespace) -> Store:
    return Store.of(
        args.hot,
        args.cold,
        hot_options=options_of(args.hot_option),
        cold_options=options_of(args.cold_option),
    )


def options_of(pairs: list[str] | None) -> dict[str, Any]:
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


def run_text(run: str | None, job: str | None) -> str:
    """A checkpoint's run in a table: its name; ``(job)`` when none was named, the
    scheduler's id of the job that saved it (display only); ``-`` when neither is recorded."""
    if run is not None:
        return run
    return f"({job})" if job is not None else "-"


def structure_text(fingerprint: str | None) -> str:
    """A structure fingerprint in a table: its first 8 hex digits (``-``: not recorded)."""
    return fingerprint.removeprefix("sha256:")[:8] if fingerprint is not None else "-"


def age_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} d"


def metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{name}={value:.6g}" for name, value in sorted(metrics.items()))


def say_error(
    command: str | None,
    as_json: bool,
    error: str,
    message: str,
    code: int,
    *,
    plain: str | None = None,
    where: Mapping[str, Any] | None = None,
) -> int:
    """Report an error of ``command`` on stderr, the one way every error of the command is
    reported; ``code``, the exit code, is returned. As text, ``plain`` (by default the line
    ``tierstore COMMAND: message``; argparse's usage and error lines for its own errors); under
    ``--json`` one line, one JSON object: ``error`` (a type name), ``message``, ``exit_code``,
    ``command`` and what ``where`` holds (``tier``, ``checkpoint``, ``file``, ... as the error
    carries them). Stdout keeps only results, so that a script reads it as JSON whatever
    happened."""
    if as_json:
        body = {"error": error, "message": message, "exit_code": code, "command": command}
        body.update((k, v) for k, v in (where or {}).items() if k not in body)
        print(json.dumps(body, default=str), file=sys.stderr, flush=True)
    else:
        print(plain or f"tierstore {command}: {message}", file=sys.stderr, flush=True)
    return code


def say_unreachable(args: argparse.Namespace, why: str) -> int:
    """The cold tier did not answer: the command showed the hot tier alone (exit 1)."""
    cold = redact_url(args.cold)
    message = f"the cold tier {cold} is unreachable ({why}); showing the hot tier only"
    where = {"tier": f"cold {cold}"}
    return say_error(args.command, args.json, "ColdTierUnreachable", message, EXIT_ERROR, where=where)


def require_named(store: Store, name: str | None) -> None:
    """Refuse a ``--name`` that no tier of ``store`` commits."""
    if name is not None and not any(t.find_manifest(name) for t in store.tiers):
        raise CheckpointNotFound("no committed checkpoint of that name", checkpoint=name, tier=store.label)


def require_picked(args: argparse.Namespace, tiers: list[Tier]) -> None:
    """Refuse ``--step`` and ``--name`` naming different checkpoints (a usage error)."""
    if args.name is None or args.step is None:
        return
    manifest, _ = resolve(tiers, name=args.name)
    if manifest.step != args.step:
        raise UsageError(
            f"--step {args.step} and --name {args.name} contradict each other: "
            f"{args.name} is step {manifest.step}"
        )


def quarantine_rows(store: Store) -> list[dict[str, Any]]:
    return [
        {
            "name": q.name,
            "attempt": q.attempt,
            "step": q.step,
            "tier": q.tier,
            "size": q.size,
            "reason": q.reason,
            "when": q.when,
        }
        for q in list_quarantined(store)
    ]


def print_quarantined(rows: list[dict[str, Any]]) -> None:
    """The quarantined checkpoints under a listing (``ls``, ``status``), if there are any."""
    if not rows:
        return
    print(
        f"\nquarantined (found damaged by a resume, un-published, data kept; "
        f"`tierstore quarantine` to remove): {len(rows)}"
    )
    for row in rows:
        step = "-" if row["step"] is None else str(row["step"])
        print(f"  {row['name']:<24}{step:>10}{size_text(row['size']):>12}  {row['tier']}  {row['reason']}")


def status_json(status: Any) -> dict[str, Any]:
    body = asdict(status)
    body["state"] = status.state.value
    body["lag_bytes"] = status.lag_bytes
    return body


def migration_config(args: argparse.Namespace) -> MigrationOptions:
    """``--concurrency`` and ``--bandwidth`` (MiB/s) of the commands that copy files."""
    bandwidth = args.bandwidth * 2**20 if args.bandwidth else None
    return MigrationOptions(concurrency=args.concurrency, bandwidth=bandwidth)


def said_json(args: argparse.Namespace, manifest: Any, **more: Any) -> bool:
    """The end of a command that copied a checkpoint: its progress display closed and, with
    ``--json``, one line of JSON printed (name, step, attempt, then ``more``); whether it was."""
    args.progress.close()
    if args.json:
        print(json.dumps({"name": manifest.name, "step": manifest.step, "attempt": manifest.attempt, **more}))
    return bool(args.json)
