"""Operator commands as actors of the multi-actor machine (multi_actor.py): ``tierstore
export --force`` and ``tierstore verify``, each held between its check and its act
(docs/design.md invariant 19) while another actor runs (issue 34, item 4: operator commands
never destroy the store).

* **export --force** into an output drawn among a fresh directory, an earlier export (which
  force replaces), a tier's root, a folder inside a tier and one above a tier (the machine's
  root, which holds both tiers), held at ``export.before_replace`` while a prune, a save or
  GC runs. It promises to refuse every output that is, is in or holds a tier, and to write a
  fresh one whole; the machine's invariants already hold it to never removing a committed
  checkpoint (nothing vanishes but by a prune's plan, every file a manifest names is there).
* **verify** held at ``verify.after_listing`` (of the hot tier, or of the cold tier alone)
  while a prune deletes checkpoints it listed. The machine damages no committed byte, so
  its report must call nothing damaged: a file gone because its checkpoint was un-published
  is not damage.

A machine derived from the suite's for one purpose (a catch of test_suite_catches_bugs.py,
which names the rules it leaves out) runs these rules only if it sets ``operator_actors =
True``: their steps would thin out its search, as they did (a catch missed in its budget).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from multi_actor import SURFACED, Step

from tierstore.dcp.export import TORCH_FILE, export
from tierstore.format import layout
from tierstore.lifecycle.scrub import verify_store
from tierstore.tiers.tier import Store as TierStore
from tierstore.tiers.tier import Tier

__all__ = ["OperatorActors", "ExportStep", "OUTS"]

# Where export --force may be pointed; all but the first two must be refused.
OUTS = ("fresh", "earlier-export", "hot-root", "inside-hot", "above-both", "cold-root", "inside-cold")
FINE = ("fresh", "earlier-export")
# What an export into a fine directory may fail with, clearly, writing nothing: no checkpoint
# committed yet, or the one it resolved pruned (or saved again) before its data was read.
GONE = ("CheckpointNotFound", "replaced by another attempt while it was exported")


@dataclass
class ExportStep(Step):
    """An export, with where it was pointed."""

    out_kind: str = "fresh"
    out: str = ""


class OperatorActors:
    """``export-force`` and ``verify``: mixed into :class:`test_multi_actor.MultiActor`."""

    root: Path
    store: Any
    s3: dict[str, Any] | None
    operator_actors = True  # the rules below run (module docstring)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        derived = any(OperatorActors in base.__mro__ and base is not OperatorActors for base in cls.__bases__)
        if derived and "operator_actors" not in cls.__dict__:
            cls.operator_actors = False  # a machine for one purpose: it opts in

    # -- export --force --------------------------------------------------------------------

    def _out(self, kind: str) -> str:
        s = self.store
        earlier = sorted(self.root.glob("export-*/" + TORCH_FILE))
        if kind == "earlier-export" and earlier:
            return str(earlier[-1].parent)
        return {
            "hot-root": s.hot,
            "inside-hot": os.path.join(s.hot, layout.DATA_DIR),
            "above-both": str(self.root),
            "cold-root": s.cold,
            "inside-cold": os.path.join(s.cold, layout.MANIFEST_DIR),
        }.get(kind, str(self.root / f"export-{uuid.uuid4().hex[:8]}"))

    def actor_export_force(self, data: st.DataObject, *, a_in_flight: str | None) -> ExportStep:
        local_cold = self.s3 is None  # an object store has no directory to point at
        kinds = OUTS if local_cold else tuple(k for k in OUTS if "cold" not in k)
        kind = data.draw(st.sampled_from(kinds), label="export --force --out")
        out = self._out(kind)
        s = self.store

        def export_(rank: int) -> str:
            store = TierStore.of(s.hot, s.cold, cold_options=s.options)
            return export(store, out=out, format="torch", force=True).name

        return ExportStep("export-force", export_, out_kind=kind, out=out)

    def check_export_force(self, step: ExportStep, outcome: Any, *, faulted: bool) -> None:
        if outcome.killed:
            return
        kind, error = step.out_kind, outcome.errors[0] or ""
        if kind not in FINE:
            assert outcome.error_types == ["ConfigError"] and "tier" in error, (
                f"export --force --out {kind} ({step.out}) was not refused: {outcome.results} {error}"
            )
            return
        if outcome.ok:
            assert os.listdir(step.out) == [TORCH_FILE], f"export into {step.out}: {os.listdir(step.out)}"
            return
        gone = outcome.error_types == [GONE[0]] or GONE[1] in error
        assert gone or (faulted and set(outcome.error_types) <= SURFACED), (
            f"export --force --out {kind}: {error}"
        )

    @precondition(lambda self: self.operator_actors)
    @rule(data=st.data(), b=st.sampled_from(("prune", "saves", "gc")))
    def export_force_held_before_its_replace(self, data: st.DataObject, b: str) -> None:
        """An export held between its output's check and its replace while B runs (a
        refused export never gets there: B then runs beside nothing)."""
        self.force(data, "export-force", "export.before_replace", b, "none", "none", "release")  # type: ignore[attr-defined]

    # -- verify ----------------------------------------------------------------------------

    def actor_verify(self, data: st.DataObject, *, a_in_flight: str | None) -> Step:
        # Held after its first listing: the hot tier's, or (cold only) the cold tier's.
        tiers = data.draw(st.sampled_from(("both", "cold")), label="verify's tiers")
        s = self.store

        def verify(rank: int) -> list[tuple[str, str, str, bool, bool, str | None]]:
            cold = Tier("cold", s.cold, s.options)
            store = TierStore.of_tiers(Tier("hot", s.hot) if tiers == "both" else None, cold)
            return [(c.tier, c.checkpoint, c.file, c.ok, c.pruned, c.problem) for c in verify_store(store)]

        return Step("verify", verify)

    def check_verify(self, step: Step, outcome: Any, *, faulted: bool) -> None:
        if outcome.killed:
            return
        if not outcome.ok:  # its own run is fault-free: only a prune's faults came before it
            assert faulted and set(outcome.error_types) <= SURFACED, f"verify: {outcome.errors}"
            return
        damaged = [c for c in outcome.results[0] if not c[3]]
        assert not damaged, f"verify called a checkpoint damaged when nothing was: {damaged}"

    @precondition(lambda self: self.operator_actors)
    @rule(
        data=st.data(),
        b=st.sampled_from(("prune", "prune-cold", "prune-hot")),
        wire_b=st.sampled_from(("none", "none", "slowdown", "reset")),
    )
    def verify_held_after_its_listing_while_a_prune_runs(
        self, data: st.DataObject, b: str, wire_b: str
    ) -> None:
        self.force(data, "verify", "verify.after_listing", b, wire_b, "none", "release")  # type: ignore[attr-defined]
