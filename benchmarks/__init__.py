"""tierstore benchmarks: ``python -m benchmarks --profile quick|full|smoke`` (``make bench``).

Every figure is a ratio against a baseline measured in the same run, repeated and reduced
to medians: absolute times on shared machines mean little. See ``docs/benchmarks.md``.

- ``run``: the command line and the driver; ``profiles``: what each profile measures.
- ``jobs/``: the measurements: the suites (``suites.py``) and the processes they start
  (multi-rank ``rank_job`` with ``saves``/``loads``, and one-process job modules).
- ``infra/``: what the jobs run on: the launcher (built on ``tests/launch.py``), moto and
  the latency proxy, timers and peak-RSS, statistics, the machine's description.
- ``report/``: results to the tables and figures of ``docs/benchmarks.md``, whose prose is
  written by hand.
"""
