"""Counters behind the suite's summary line."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    faults: int = 0  # crashes that fired, corruptions, injected errors
    crash_points: set[str] = field(default_factory=set)
    violations: int = 0
    messages: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"crash-suite: {self.examples} examples, {self.steps} steps, "
            f"{len(self.crash_points)} distinct crash points hit, {self.faults} faults "
            f"injected, {self.violations} invariant violations"
        )


STATS = Stats()
