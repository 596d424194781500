"""The report: ``docs/benchmarks.md`` from a run's results (``render.write``).

``analysis`` turns records into numbers and targets; ``sections``, ``cold_down``,
``overview`` and ``findings`` put them into tables and figures (``plots``); the prose is
``template.md``, filled by ``template``. ``render`` and the sections need matplotlib (the
``bench`` extra); ``analysis``, ``tables`` and ``template`` do not.
"""
