"""tierstore benchmarks: ``python -m benchmarks --profile quick|full`` (``make bench``).

Every figure is a ratio against a baseline measured in the same run, repeated and reduced
to medians: absolute times on shared machines mean little. See ``docs/benchmarks.md``.
"""
