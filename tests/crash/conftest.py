"""The crash-consistency suite: budgets, fork safety and the one-line summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

from stats import STATS

# Forked workers inherit this process: keep torch single-threaded so no intra-op thread
# pool exists to be forked in a broken state.
torch.set_num_threads(1)

settings.register_profile(
    "ci",  # what `make test` runs: bounded, and the same examples every run
    max_examples=int(os.environ.get("TIERSTORE_CRASH_EXAMPLES", "25")),
    stateful_step_count=int(os.environ.get("TIERSTORE_CRASH_STEPS", "12")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.register_profile(
    "soak",  # `make soak`: thousands of fresh examples
    max_examples=int(os.environ.get("TIERSTORE_CRASH_EXAMPLES", "2000")),
    stateful_step_count=int(os.environ.get("TIERSTORE_CRASH_STEPS", "14")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if STATS.examples or STATS.faults:
        for message in dict.fromkeys(STATS.messages):  # distinct violations, first seen first
            terminalreporter.write_line(f"crash-suite violation: {message}")
        terminalreporter.write_line(STATS.summary())


def pytest_runtest_makereport(item, call) -> None:  # type: ignore[no-untyped-def]
    failed = call.when == "call" and call.excinfo is not None and "crash" in item.nodeid
    failed = failed and item.get_closest_marker("xfail") is None  # a known bug's replay: expected
    if failed and call.excinfo.errisinstance(AssertionError) and not STATS.messages:
        STATS.violations += 1
        STATS.messages.append(str(call.excinfo.value).splitlines()[0][:500])
