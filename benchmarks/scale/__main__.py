from __future__ import annotations

from benchmarks.scale.cli import main

main()
