"""Exact resume: the training state to save, the data position, and the proof that a resume is exact.

- :mod:`~tierstore.resume.state`: ``TrainingState`` and ``ResumePlanner``.
- :mod:`~tierstore.resume.data`: ``ResumableSampler`` and ``ResumableLoader``.
- :mod:`~tierstore.resume.check`: ``verify_checkpoint`` / ``verify_resume``.
- :mod:`~tierstore.resume.probe`, :mod:`~tierstore.resume.report`: the fresh process a
  resume check runs, and its report.
- :mod:`~tierstore.resume.cadence`: how often to save.
"""
