"""Hypothesis kills writers, migrators, pruners and loaders at random fault points; every
committed checkpoint stays trustworthy (see machine.py for the invariants)."""

from __future__ import annotations

import os

from hypothesis import settings
from machine import CrashConsistency

TestCrashConsistency = CrashConsistency.TestCase
TestCrashConsistency.settings = settings.get_profile(os.environ.get("TIERSTORE_CRASH_PROFILE", "ci"))
