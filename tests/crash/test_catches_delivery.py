"""The multi-actor machine catches delivery's bugs when they are put back (issue 34, items 1
and 2; pattern: test_suite_catches_bugs.py, bugs injected by wrapping methods, never by
copying product code):

* a resumed migration that queues a job from a stale view and, once the cold policy pruned
  that attempt (its marks with it), polls for its own mark until ``commit_timeout``: the
  machine's ``deliver`` actor, held between its view and its queueing while a migration
  commits, then before its marks listing while the cold tier is pruned, must report it;
* a run's end that stops at the first failure (no retry, no probe): the ``close`` actor,
  whose cold tier refuses for a moment as it finishes, must report a checkpoint left
  pending after a blip.
"""

from __future__ import annotations

import re
import time
import traceback
from typing import Any

import pytest
from actors_delivery import DeliveryActors
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import rule, run_state_machine_as_test
from multi_actor import Machine
from stats import STATS
from test_multi_actor import s3_cold
from test_suite_catches_bugs import generated

from tierstore.migration import delivery
from tierstore.migration.jobs import JobFailed
from tierstore.migration.migrator import Migrator


class DeliveryOnly(DeliveryActors, Machine):
    """The machine with delivery's actors and none of the other mixins': where the bug shows."""

    worlds = (1,)

    interleave = two_migrators_of_one_checkpoint = damage_an_upload_mark = None  # type: ignore[assignment]
    replace_an_uploaded_object = migrate_once_the_faults_stop = None  # type: ignore[assignment]
    close_held_while_another_runs = deliver_held_while_another_runs = None  # type: ignore[assignment]

    @rule(data=st.data())
    def two_saves_alone(self, data: st.DataObject) -> None:
        """Committed in cold, two at a time: something for the cold prune to take."""
        for _ in range(2):
            self.save_alone(data)


def expect_caught(machine: Any, match: str, config: Any) -> None:
    """Run ``machine``: an actor's promise (its ``check_<kind>``) or an invariant must fail
    with ``match``, not the harness."""
    violations = STATS.violations
    try:
        run_state_machine_as_test(machine, settings=config)
    except (AssertionError, FlakyFailure) as err:
        error: BaseException = err
    else:
        pytest.fail(f"{machine.__name__} caught nothing in {config.max_examples} examples")
    finally:
        STATS.violations = violations
        STATS.messages.clear()
    if isinstance(error, FlakyFailure):
        error = next((e for e in error.exceptions if isinstance(e, AssertionError)), error)
    assert re.search(match, str(error)), f"caught {error!r}, not /{match}/"
    frames = {frame.name for frame in traceback.extract_tb(error.__traceback__)}
    assert any(name.startswith(("check_", "nothing_", "every_")) for name in frames), frames


def polling_for_deleted_marks(self: Migrator, manifest: Any, ranks: list[int]) -> None:
    """The old wait: a mark that vanished is waited for until ``commit_timeout``."""
    time.sleep(self.config.commit_timeout)
    raise JobFailed(
        ranks[0], None, f"no upload mark from ranks {ranks} after {self.config.commit_timeout:.0f}s"
    )


def test_multi_actor_machine_catches_a_resumed_job_waiting_for_a_pruned_attempt(monkeypatch) -> None:
    # Forked actors inherit the patches.
    monkeypatch.setattr(Migrator, "_delivered_already", lambda self, job: False)  # no look first
    monkeypatch.setattr(Migrator, "_marks_deleted", polling_for_deleted_marks)
    expect_caught(DeliveryOnly, "failed or waited with no fault", generated(12, 5, quiet=True))


class CloseOnly(DeliveryOnly):
    deliver_between_two_actors = two_saves_alone = None  # type: ignore[assignment]

    @rule(data=st.data(), wire_a=st.sampled_from(("refuse", "stall")))
    def close_in_a_blip(self, data: st.DataObject, wire_a: str) -> None:
        self._wire_a = wire_a
        self.force(data, "close", "migrator.before_marks_listing", "load", "none", wire_a, "release")


def one_pass(
    migrators: Any, cold: Any, deadline: Any, *, names: Any = None, give_up_after: Any = None
) -> None:
    """The old end of a run: each migration waited for once; what failed stays failed."""
    delivery.await_delivery(migrators, deadline, names=names)


def test_multi_actor_machine_catches_a_close_that_gives_up_at_the_first_failure(
    monkeypatch, s3_endpoint: str, s3_bucket: str
) -> None:
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    from tierstore.manager import ending

    monkeypatch.setattr(ending, "deliver", one_pass)
    with s3_cold(s3_endpoint, s3_bucket):
        expect_caught(CloseOnly, "left .* pending after a blip", generated(4, 3, quiet=True))
