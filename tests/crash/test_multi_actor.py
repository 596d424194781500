"""The multi-actor machine as the suite runs it: :class:`multi_actor.Machine` (its actors,
rules and invariants: see that module's docstring) with every actor mixin composed in. A
mixin adds the actors of one capability (``actor_<kind>``, ``check_<kind>``) and the rules
that hold them between a check and its act (docs/design.md invariant 19)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from actors_delivery import DeliveryActors
from actors_operator import OperatorActors
from actors_quarantine import QuarantineActors
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from multi_actor import PROFILE, Machine


class MultiActor(DeliveryActors, OperatorActors, QuarantineActors, Machine):
    """Every actor of the suite on one store."""


def _forget_the_proxy() -> None:
    """A forked actor must not keep the proxy's listening socket open: the parent could not
    refuse connections (or listen again) on that port while the child holds a copy."""
    proxy = (Machine.s3 or {}).get("proxy")
    for sock in (getattr(getattr(proxy, "_server", None), "socket", None), getattr(proxy, "_hold", None)):
        if sock is not None:
            sock.close()  # the child's copy only


os.register_at_fork(after_in_child=_forget_the_proxy)


def _settings(examples: int, steps: int, *, shrink: bool = True) -> settings:
    base = settings.get_profile(PROFILE)
    # Shrinking a failure over a real object store takes many minutes: the full failing
    # example is printed instead (every step, every draw), and replays from the blob.
    phases = tuple(p for p in Phase if shrink or p is not Phase.shrink)
    if PROFILE == "ci":
        return settings(base, max_examples=examples, stateful_step_count=steps, phases=phases)
    return settings(base, max_examples=max(1, base.max_examples // 4), phases=phases)  # soak: 500


def run_local(machine: type[Machine] = MultiActor, config: settings | None = None) -> None:
    Machine.s3 = None
    run_state_machine_as_test(machine, settings=config or _settings(6, 6))


@contextmanager
def s3_cold(endpoint: str, bucket: str) -> Iterator[None]:
    from s3_fault_proxy import FaultProxy

    proxy = FaultProxy(endpoint)
    Machine.s3 = {"endpoint": endpoint, "bucket": bucket, "proxy": proxy}  # every machine's
    try:
        yield
    finally:
        Machine.s3 = None
        proxy.close()


def test_multi_actor_local_cold() -> None:
    run_local()


def test_multi_actor_s3_cold_with_wire_faults(s3_endpoint: str, s3_bucket: str) -> None:
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    with s3_cold(s3_endpoint, s3_bucket):
        run_state_machine_as_test(MultiActor, settings=_settings(4, 6, shrink=False))
