"""The suite catches the operator-command bugs of issue 34 item 4 when they are put back
(the pattern of test_suite_catches_bugs.py: one public function wrapped or replaced, never
product code copied):

* export with no tier rule (``--force --out`` a tier's root, a folder in it or above it
  replaced it): the machine's export actor finds an export into a tier that was not refused;
  with that promise left unchecked, its invariants find the checkpoints it deleted gone;
* verify without its re-check (every missing file is damage): the machine's verify actor,
  held after its listing while a prune runs, finds a checkpoint called damaged when the
  machine damaged nothing;
* the throttle that charged each chunk's time to the next (the last chunk free): its tests
  (tests/tiers/test_throttle_charges.py) fail.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis.errors import Flaky, FlakyFailure
from hypothesis.stateful import INVARIANT_MARKER, RULE_MARKER, run_state_machine_as_test
from stats import STATS
from test_multi_actor import MultiActor
from test_suite_catches_bugs import generated

from tierstore.dcp import export as export_mod
from tierstore.lifecycle import scrub
from tierstore.migration.transfer import Throttle


def only(*rules: str, **overrides: Any) -> type[MultiActor]:
    """The machine with only ``rules`` (every other rule of every mixin taken out)."""
    others = {
        name: None
        for name, fn in inspect.getmembers(MultiActor)
        if getattr(fn, RULE_MARKER, None) is not None and name not in rules
    }
    namespace = {"worlds": (1,), "operator_actors": True, **others, **overrides}
    return type("Only_" + "_".join(rules), (MultiActor,), namespace)


def caught(machine: type[MultiActor], match: str, config: Any, where: set[str]) -> str:
    """Run ``machine``: it must fail with an ``AssertionError`` matching ``match`` raised in
    one of its invariants or in a function named in ``where``; the message. A run that
    hypothesis abandons as flaky before any catch is run again (three runs at most)."""
    invariants = {name for name, fn in inspect.getmembers(machine) if getattr(fn, INVARIANT_MARKER, None)}
    violations, error = STATS.violations, None
    for _ in range(3):
        try:
            run_state_machine_as_test(machine, settings=config)
        except (AssertionError, Flaky) as err:
            error = err
        else:
            pytest.fail(f"{machine.__name__} caught nothing in {config.max_examples} examples")
        STATS.violations = violations
        STATS.messages.clear()
        if isinstance(error, FlakyFailure):
            error = next((e for e in error.exceptions if isinstance(e, AssertionError)), error)
        if isinstance(error, AssertionError):
            assert re.search(match, str(error)), f"caught {error!r}, not /{match}/"
            failed_in = {frame.name for frame in traceback.extract_tb(error.__traceback__)}
            assert failed_in & (invariants | where), f"failed outside {sorted(invariants | where)}: {error}"
            return str(error)
    pytest.fail(f"{machine.__name__}: three runs abandoned as flaky before any catch: {error!r}")


def no_tier_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """export as it was: --force replaced any directory, a tier's or one holding it."""
    monkeypatch.setattr(export_mod, "refuse_overlap", lambda *args, **kwargs: None)
    monkeypatch.setattr(export_mod, "_refuse_replacing", lambda target: None)


def test_the_machine_catches_an_export_that_replaces_a_tier(monkeypatch) -> None:
    no_tier_rule(monkeypatch)  # forked actors inherit the patch
    machine = only("save_alone", "export_force_held_before_its_replace")
    said = caught(machine, "was not refused", generated(10, 4, quiet=True), {"check_export_force"})
    print(said.splitlines()[0])


def test_its_invariants_alone_catch_what_such_an_export_deletes(monkeypatch) -> None:
    no_tier_rule(monkeypatch)

    def unchecked(self: Any, step: Any, outcome: Any, *, faulted: bool) -> None:
        """The export's promise left unchecked: what the invariants see on their own."""

    machine = only("save_alone", "export_force_held_before_its_replace", check_export_force=unchecked)
    said = caught(
        machine, "vanished|names missing|without ever being committed", generated(10, 4, quiet=True), set()
    )
    print(said.splitlines()[0])


def test_the_machine_catches_a_verify_that_calls_a_pruned_checkpoint_damaged(monkeypatch) -> None:
    # verify as it was: a missing file was damage whether or not its checkpoint was still there.
    monkeypatch.setattr(scrub, "_unpublished", lambda tier, manifest: False)
    machine = only("save_alone", "verify_held_after_its_listing_while_a_prune_runs")
    said = caught(machine, "called a checkpoint damaged", generated(30, 10, quiet=True), {"check_verify"})
    print(said.splitlines()[0])


@contextmanager
def _charged_to_the_next(self: Throttle, nbytes: int) -> Any:
    """Throttle.sending as it was: the chunk waits only for the chunks before it."""
    if self.rate:
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            self._sleep(start - now)
    yield


def test_the_throttle_tests_catch_the_last_chunk_going_free(monkeypatch, tmp_path: Path) -> None:
    path = Path(__file__).parents[1] / "tiers" / "test_throttle_charges.py"
    spec = importlib.util.spec_from_file_location("throttle_charges", path)
    assert spec is not None and spec.loader is not None
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    monkeypatch.setattr(Throttle, "sending", _charged_to_the_next)
    for test in (tests.test_one_chunk_is_paid_in_full, tests.test_every_chunk_is_paid_the_last_one_too):
        with pytest.raises(AssertionError):
            test()
    with pytest.raises(AssertionError):
        tests.test_copy_file_pays_for_a_file_of_one_chunk(tmp_path)
