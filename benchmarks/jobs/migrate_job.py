"""Migration throughput and memory: ``python -m benchmarks.jobs.migrate_job SPEC.json OUT.json``.

Compares ``tierstore.migrate_pending`` (hot -> S3, verified, with upload marks and the cold
manifest) with plain ``s3fs`` ``put_file`` of the very same files to the same server, at the
same part size and the same number of parts in flight, each from a fresh client. Runs in
one process of its own, so the peak-RSS growth of each transfer is measured cleanly
(``/proc/self/clear_refs`` before, ``VmHWM`` after).
"""

from __future__ import annotations

import uuid
import warnings
from typing import Any

from benchmarks.infra.launch import module_main
from benchmarks.infra.measure import MiB, Record, cpu_seconds, now, peak_growth, reset_peak_rss
from benchmarks.infra.servers import S3Target, remove_prefix
from tierstore import Store

warnings.filterwarnings("ignore")


def hot_files(hot: str, name: str) -> tuple[list[tuple[str, str]], int]:
    """(local path, relative path) of every file of checkpoint ``name``, and their bytes."""
    from tierstore.tiers.tier import Tier

    tier = Tier("hot", hot)
    manifest = tier.find_manifest(name)
    assert manifest is not None, f"no checkpoint {name} in {hot}"
    local = tier.backend.local_path  # type: ignore[attr-defined]
    files = [(local(tier.file_key(name, manifest.attempt, f.path)), f.path) for f in manifest.files]
    return files, manifest.total_size


def forget_migration(hot: str, name: str) -> None:
    """Make the hot checkpoint pending again: drop the hot tier's "migrated" mark, if this
    tierstore keeps one (benchmark only: every measurement migrates the same files)."""
    from tierstore.format import layout
    from tierstore.tiers.tier import Tier

    tier = Tier("hot", hot)
    for info in list(tier.backend.list(f"{layout.MIGRATED_DIR}/{name}/")):
        tier.backend.delete(info.key)


def migrate_tiered(spec: dict[str, Any], target: S3Target, name: str, inflight: int) -> Record:
    from tierstore import MigrationOptions, migrate_pending

    forget_migration(spec["hot"], name)
    cold = target.url(f"mig-{uuid.uuid4().hex[:8]}")
    options = target.tier_options(part_size=spec["part_size"], max_concurrency=inflight)
    rss = reset_peak_rss()
    cpu = cpu_seconds()
    start = now()
    results = migrate_pending(
        Store.of(spec["hot"], cold, cold_options=options),
        names=[name],
        config=MigrationOptions(chunk_size=spec["chunk_size"]),
    )
    record: Record = {"seconds": now() - start, "growth": peak_growth(rss), "cpu": cpu_seconds() - cpu}
    if [r.state.value for r in results] != ["committed"]:
        record["error"] = f"migration ended {[(r.state.value, r.error) for r in results]}"
    remove_prefix(target, cold)
    return record


def put_plain(spec: dict[str, Any], target: S3Target, name: str, inflight: int) -> Record:
    import s3fs

    files, _ = hot_files(spec["hot"], name)
    prefix = f"put-{uuid.uuid4().hex[:8]}"
    rss = reset_peak_rss()
    cpu = cpu_seconds()
    start = now()
    fs = s3fs.S3FileSystem(**target.fsspec_options(), skip_instance_cache=True)
    for path, rel in files:
        fs.put_file(
            path, f"{target.bucket}/{prefix}/{rel}", chunksize=spec["part_size"], max_concurrency=inflight
        )
    record: Record = {"seconds": now() - start, "growth": peak_growth(rss), "cpu": cpu_seconds() - cpu}
    remove_prefix(target, target.url(prefix))
    return record


KINDS = {"tiered": migrate_tiered, "s3fs": put_plain}


def measure(
    spec: dict[str, Any], target: S3Target, kind: str, name: str, inflight: int, rep: int, group: str
) -> Record:
    _, size = hot_files(spec["hot"], name)
    record: Record = {
        "group": group,
        "variant": kind,
        "name": name,
        "bytes": size,
        "inflight": inflight,
        "rep": rep,
    }
    try:
        record.update(KINDS[kind](spec, target, name, inflight))
    except Exception as err:
        record["error"] = f"{type(err).__name__}: {err}"[:2000]
    detail = record.get("error") or (
        f"{size / MiB / record['seconds']:7.1f} MiB/s  peak RSS +{(record['growth'] or 0) / MiB:6.1f} MiB"
    )
    print(
        f"    rep {rep + 1} {group:<6} {kind:<6} {size // MiB:>5} MiB  {inflight} in flight  {detail}",
        flush=True,
    )
    return record


def warm_up(spec: dict[str, Any], target: S3Target, name: str) -> None:
    """Imports and first-client costs (botocore's models) before anything is measured."""
    for kind in KINDS:
        KINDS[kind](spec, target, name, 1)


def run(spec: dict[str, Any]) -> list[Record]:
    target = S3Target(**spec["target"])
    sweep_name = spec["sweep_name"]
    warm_up(spec, target, spec["memory_names"][0])
    records = []
    kinds = list(KINDS)
    for rep in range(spec["reps"]):
        for i, inflight in enumerate(spec["sweep"]):
            for kind in kinds[(rep + i) % 2 :] + kinds[: (rep + i) % 2]:
                records.append(measure(spec, target, kind, sweep_name, inflight, rep, "sweep"))
    # The migrator's memory by checkpoint size (the sweep's size is measured already).
    for rep in range(spec["memory_reps"]):
        for name in spec["memory_names"]:
            if name != sweep_name:
                records.append(measure(spec, target, "tiered", name, spec["default_inflight"], rep, "sizes"))
    return records


if __name__ == "__main__":
    module_main(run)
