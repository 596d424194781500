"""``tierstore du``: the bytes each tier holds, per checkpoint, and what is left to migrate."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from tierstore._redact import redact_url
from tierstore.cli.checks import cold_unreachable
from tierstore.cli.common import say_unreachable, store_of
from tierstore.cli.parser import EXIT_ERROR, EXIT_OK
from tierstore.migration.migrator import MigrationState, MigrationStatus
from tierstore.migration.status import migration_status
from tierstore.progress import size_text
from tierstore.tiers.tier import Store
from tierstore.tiers.usage import TierUsage, tier_usage

__all__ = ["cmd_du"]


def cmd_du(args: argparse.Namespace) -> int:
    store = store_of(args)
    down = cold_unreachable(store.cold, args.cold_wait)
    if down is not None:
        store = Store.of_tiers(store.hot, None)
    usages = [tier_usage(t) for t in store.tiers]
    pending: list[MigrationStatus] | None = None  # None: no pair of tiers to migrate between
    if store.hot is not None and store.cold is not None:
        pending = [s for s in migration_status(store) if s.state is not MigrationState.COMMITTED]
    if args.json:
        print(json.dumps(_body(usages, pending, down), indent=1))
    else:
        for usage in usages:
            _print_tier(usage)
        if pending is not None:
            _print_pending(pending)
        elif down is not None and store.hot is not None:
            print("pending migration: unknown (the cold tier is unreachable)")
    if down is not None:
        say_unreachable(args, down)
        return EXIT_ERROR
    return EXIT_OK


def _tier_body(usage: TierUsage) -> dict[str, Any]:
    return {
        "role": usage.role,
        "url": redact_url(usage.url),
        "bytes": usage.bytes,
        "objects": usage.objects,
        "checkpoint_bytes": usage.checkpoint_bytes,
        "other_bytes": usage.other_bytes,
        "free_bytes": usage.free_bytes,
        "checkpoints": [asdict(c) for c in usage.checkpoints],
    }


def _body(usages: list[TierUsage], pending: list[MigrationStatus] | None, down: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"tiers": [_tier_body(u) for u in usages], "cold_unreachable": down}
    if pending is None:
        body["pending"] = None  # no cold tier, or it is unreachable: unknown
    else:
        body["pending"] = {
            "bytes": sum(s.lag_bytes for s in pending),
            "checkpoints": [
                {
                    "name": s.name,
                    "step": s.step,
                    "state": s.state.value,
                    "bytes_total": s.bytes_total,
                    "bytes_left": s.lag_bytes,
                }
                for s in pending
            ],
        }
    return body


def _print_tier(usage: TierUsage) -> None:
    free = "" if usage.free_bytes is None else f", {size_text(usage.free_bytes)} free"
    print(
        f"{usage.role} tier {redact_url(usage.url)}: {size_text(usage.bytes)} in {usage.objects} "
        f"objects{free}"
    )
    print(
        f"  {len(usage.checkpoints)} committed checkpoints: {size_text(usage.checkpoint_bytes)}; "
        f"other (marks, leases, garbage: `tierstore gc` lists it): {size_text(usage.other_bytes)}"
    )
    if usage.checkpoints:
        print(f"  {'name':<24}{'step':>10}{'size':>12}{'files':>7}{'manifest':>10}{'stored':>12}")
    for c in usage.checkpoints:
        step = "-" if c.step is None else str(c.step)
        print(
            f"  {c.name:<24}{step:>10}{size_text(c.size):>12}{c.files:>7}"
            f"{size_text(c.manifest_bytes):>10}{size_text(c.stored_bytes):>12}"
        )


def _print_pending(pending: list[MigrationStatus]) -> None:
    if not pending:
        print("pending migration: none (every hot checkpoint is committed in the cold tier)")
        return
    left = sum(s.lag_bytes for s in pending)
    print(f"pending migration: {len(pending)} checkpoints, {size_text(left)} still to upload")
    for s in pending:
        print(f"  {s.name:<24}{s.state.value:<11}{size_text(s.lag_bytes):>10} of {size_text(s.bytes_total)}")
