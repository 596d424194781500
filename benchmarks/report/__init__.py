"""The report: the tables and figures of ``docs/benchmarks.md`` from a run's results
(``render.write``); its prose is written by hand there.

``analysis`` turns records into numbers and targets; ``sections``, ``perf``, ``loop``,
``cold_down``, ``preemption`` and ``overview`` put them into tables and figures (``plots``),
each a part named in ``render.PARTS``. Figures need matplotlib (the ``bench`` extra); without
it a figure's place says it was not drawn.
"""
