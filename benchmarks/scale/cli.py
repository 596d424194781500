"""``python -m benchmarks.scale``: replay W = 8 ... 16,384 ranks, report, plot, splice the page.

Backends: ``local`` (hot and cold tiers are two local directories, on /dev/shm where it
exists, so the counts and not a disk's fsyncs dominate) and ``s3`` (hot local, cold the moto
S3 server in its own process). Each W runs in fresh directories (a fresh bucket on S3); a
backend stops early once the next W, predicted from the last one's time, would overrun its
time budget, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.scale.features import features
from benchmarks.scale.plot import plot_requests
from benchmarks.scale.report import render, splice
from benchmarks.scale.results import Measurement, measure
from benchmarks.scale.sim import SimConfig, simulate

__all__ = ["main", "PROFILES", "run_backend"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Profile:
    worlds: dict[str, tuple[int, ...]]
    budget: dict[str, float]  # seconds per backend, all its W together
    doc: str
    load_sample: int = 64


PROFILES = {
    "smoke": Profile(
        {"local": (8, 64), "s3": (8,)},
        {"local": 120, "s3": 120},
        "bench-scratch/scale/scale.md",
        load_sample=16,
    ),
    "quick": Profile(
        {"local": (8, 64, 512, 4096), "s3": (8, 64, 512, 1024)}, {"local": 900, "s3": 600}, "docs/scale.md"
    ),
    # S3: 2,048 is the first W past one manifest part (1,024 ranks) that the emulator answers
    # within the budget on a 2-core machine; 4,096 and up run where the budget allows.
    "full": Profile(
        {"local": (8, 64, 512, 4096, 16384), "s3": (8, 64, 512, 2048, 4096, 16384)},
        {"local": 1800, "s3": 900},
        "docs/scale.md",
    ),
}


def _scratch() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="tierstore-scale-", dir=shm if shm.is_dir() else None))


@contextmanager
def _local_cold(world: int, root: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    yield str(root / "cold"), {}


@contextmanager
def _moto() -> Iterator[Callable[[int, Path], Any]]:
    from benchmarks.infra.servers import create_bucket, reset_moto, start_moto

    server = start_moto()

    @contextmanager
    def cold(world: int, root: Path) -> Iterator[tuple[str, dict[str, Any]]]:
        target = create_bucket(server.url, f"scale-{world}")
        try:
            yield target.url("run"), target.tier_options()
        finally:
            reset_moto(server.url)

    try:
        yield cold
    finally:
        server.stop()


def run_backend(
    backend: str,
    worlds: Sequence[int],
    cold: Callable[[int, Path], Any],
    *,
    budget: float,
    load_sample: int,
    notes: list[str],
    part_ranks: int | None = None,
) -> list[Measurement]:
    """Replay each W in turn on one backend; stop before a W predicted to overrun ``budget``."""
    done: list[Measurement] = []
    spent = 0.0
    for world in worlds:
        if done and spent + done[-1].seconds * world / done[-1].world > budget:
            notes.append(
                f"{backend}: W={world} and above skipped: predicted to overrun the "
                f"{budget:.0f} s budget (W={done[-1].world} took {done[-1].seconds:.0f} s)"
            )
            break
        root = _scratch()
        try:
            with cold(world, root) as (cold_url, cold_options):
                config = SimConfig(
                    world,
                    str(root / "hot"),
                    cold_url,
                    cold_options,
                    load_sample=load_sample,
                    part_ranks=part_ranks,
                )
                start = time.perf_counter()
                run = simulate(config)
                seconds = time.perf_counter() - start
        finally:
            shutil.rmtree(root, ignore_errors=True)
        spent += seconds
        done.append(measure(run, backend, seconds))
        log.warning("scale %s W=%d: %.1f s", backend, world, seconds)
    return done


def _s3_missing() -> str | None:
    try:
        from tierstore.storage.registry import backend_class

        backend_class("s3")
        import moto.server  # noqa: F401
    except Exception as err:
        return f"s3: not run ({type(err).__name__}: {err})"
    return None


def _run_all(
    profile: Profile,
    backends: Sequence[str],
    notes: list[str],
) -> dict[str, list[Measurement]]:
    out: dict[str, list[Measurement]] = {}
    for backend in backends:
        worlds, budget = profile.worlds[backend], profile.budget[backend]
        if backend == "local":
            out[backend] = run_backend(
                backend, worlds, _local_cold, budget=budget, load_sample=profile.load_sample, notes=notes
            )
            continue
        missing = _s3_missing()
        if missing:
            notes.append(missing)
            continue
        with _moto() as cold:
            out[backend] = run_backend(
                backend, worlds, cold, budget=budget, load_sample=profile.load_sample, notes=notes
            )
    return out


def _results_path(name: str) -> Path:
    return REPO / "benchmarks" / "results" / f"scale-{name}.json"


def _saved(name: str) -> tuple[dict[str, list[Measurement]], list[str], dict[str, str]]:
    """A previous run's results, notes and features (``--render-only``)."""
    payload = json.loads(_results_path(name).read_text())
    results = {b: [Measurement.from_json(m) for m in ms] for b, ms in payload["results"].items()}
    return results, list(payload["notes"]), dict(payload["features"])


def _publish(
    name: str,
    results: dict[str, list[Measurement]],
    notes: list[str],
    found: dict[str, str] | None,
    *,
    doc: Path,
) -> None:
    """Record a fresh run (``found`` ``None``) and rebuild the page and plots from ``results``."""
    out = _results_path(name)
    if found is None:  # a fresh run: record it
        found = features()
        payload = {
            "profile": name,
            "features": found,
            "notes": notes,
            "results": {b: [m.to_json() for m in ms] for b, ms in results.items()},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1))
    images = {}
    for backend, ms in results.items():
        path = doc.parent / "img" / "scale" / f"requests-{backend}.png"
        if plot_requests(ms, backend, path) is not None:
            images[backend] = str(path.relative_to(doc.parent))
    splice(doc, render(results, found, notes, name, images))
    print(f"results: {out}\nreport: {doc}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    parser.add_argument("--doc", type=Path, help="page to splice the tables into")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rebuild the page and plots from the profile's saved results",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    profile = PROFILES[args.profile]
    doc = args.doc or REPO / profile.doc
    doc.parent.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        _publish(args.profile, *_saved(args.profile), doc=doc)
        return
    notes: list[str] = []
    results = _run_all(profile, [b for b in args.backends.split(",") if b], notes)
    _publish(args.profile, results, notes, None, doc=doc)
