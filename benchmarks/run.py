"""Run a benchmark profile end to end: servers, every suite, results JSON, the report.

``python -m benchmarks [--profile quick|full] [--only save,latency,...] [--scratch DIR]``
``python -m benchmarks --report-only benchmarks/results/quick.json``
``python -m benchmarks --only cold-down`` (re-measure one suite: its tables alone are updated)

The report's prose is written by hand in ``docs/benchmarks.md``; a run updates the tables and
figures it measured there (``report/render.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.infra import machine
from benchmarks.infra.launch import ROOT, rank_env
from benchmarks.infra.servers import S3Target, create_bucket, start_moto
from benchmarks.jobs.suites import SUITES, Bench
from benchmarks.profiles import PROFILES, Profile
from benchmarks.report.tables import DOC

RESULTS = ROOT / "benchmarks" / "results"


def probe_s3torch(target: S3Target) -> dict[str, Any]:
    answer = subprocess.run(
        [sys.executable, "-m", "benchmarks.jobs.probe_s3torch", target.endpoint, target.bucket],
        cwd=ROOT,
        env=rank_env(0, 1, 0),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        return dict(json.loads(answer.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"available": False, "reason": f"probe crashed: {answer.stderr[-500:]}"}


def run_profile(profile: Profile, only: list[str], scratch_root: Path) -> dict[str, Any]:
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"bench-{profile.name}-", dir=scratch_root))
    moto = start_moto()
    started = time.time()
    results: dict[str, Any] = {
        "profile": profile.to_json(),
        "machine": machine.describe(scratch),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "suites": {},
    }
    try:
        bench = Bench(profile, scratch, moto, create_bucket(moto.url, "tierstore-bench"))
        bench.s3torch = results["s3torch"] = probe_s3torch(bench.target)
        print(f"s3torchconnector: {bench.s3torch}", flush=True)
        for name in only:
            begun = time.time()
            print(f"[{time.time() - started:5.0f}s] {name}", flush=True)
            results["suites"][name] = SUITES[name](bench)
            results["suites"][name]["seconds"] = time.time() - begun
    finally:
        moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    results["seconds"] = time.time() - started
    return results


def save_results(results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = results["profile"]["name"]
    stamped = RESULTS / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    stamped.write_text(json.dumps(results, indent=1))
    shutil.copyfile(stamped, RESULTS / f"{name}.json")
    return stamped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument(
        "--only", default=",".join(SUITES), help=f"comma-separated suites ({', '.join(SUITES)})"
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=ROOT / "bench-scratch",
        help="where checkpoints are written (the hot tier's disk); emptied after",
    )
    parser.add_argument("--report-only", type=Path, help="render the report from a results JSON")
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument(
        "--doc", type=Path, default=DOC, help="where the report goes (its figures: img/benchmarks/ beside it)"
    )
    parser.add_argument(
        "--splice",
        action="store_true",
        help="what every run does now: update only the tables of the suites run (make bench-perf passes it)",
    )
    args = parser.parse_args(argv)
    from benchmarks.report import render

    if args.report_only:
        results = json.loads(args.report_only.read_text())
        print(f"report: {render.write(results, args.doc)} updated in {args.doc}", flush=True)
        return
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SUITES))
    if unknown:
        parser.error(f"unknown suites {unknown}")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    results = run_profile(PROFILES[args.profile], only, args.scratch)
    path = save_results(results)
    print(f"results: {path.relative_to(ROOT)} ({results['seconds']:.0f}s)", flush=True)
    if args.no_report:
        return
    print(f"report: {render.write(results, args.doc)} updated in {args.doc}", flush=True)


if __name__ == "__main__":
    main()
