"""The measurements. ``suites.py`` runs in the driver and starts the rest in processes of
their own: ``rank_job`` (one per rank: ``saves``, ``loads``, with ``rank_context`` and
``writers``) and the one-process job modules ``cpu_costs``, ``migrate_job``, ``gpu``,
``cold_down`` and ``probe_s3torch``, each ``python -m benchmarks.jobs.NAME SPEC OUT``."""
