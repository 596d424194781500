"""Arming tierstore's fault points: for tests, and only through here.

The library marks the moments a crash could matter with ``faults.point(name)``
(:mod:`tierstore.storage.faults`, the list in docs/crash-consistency.md) and never arms one
itself: no variable in a production process's environment makes a point raise, sleep, block
or kill. A test arms them.

In this process, in code::

    from tierstore.testing import faults
    faults.arm("writer.after_file_write", "kill", hit=2)   # the 2nd time it is passed
    faults.trace(path)                                      # every point passed, to a file
    faults.disarm()

In a process the test starts (``subprocess``, a launcher's ranks, multiprocessing's spawn),
through its environment::

    env = {**os.environ, **faults.armed_env("writer.after_file_write@2=kill", trace=path)}
    subprocess.run([sys.executable, script], env=env)

:func:`armed_env` names the specs in ``TIERSTORE_FAULTS`` (``pattern[@hit]=action``, several
joined by ``;``, see :func:`~tierstore.storage.faults.parse_spec`) and the trace file in
``TIERSTORE_FAULT_TRACE``, and puts this package's arming hook first on ``PYTHONPATH``: a
``sitecustomize`` module that the child's interpreter runs as it starts, and that arms what
those two variables say (:func:`arm_from_environment`). A process started without the hook
on its path ignores them. Children of an armed child inherit both, as they would the
variables alone before. The hook stands in for any other ``sitecustomize`` on the path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tierstore import settings
from tierstore.storage import faults as _points
from tierstore.storage.faults import ACTIONS, RELEASE_ALL, arm, armed, disarm, parse_spec, trace

__all__ = [
    "ACTIONS",
    "RELEASE_ALL",
    "FAULTS_ENV",
    "TRACE_ENV",
    "HOOK_DIR",
    "arm",
    "armed",
    "armed_env",
    "arm_from_environment",
    "disarm",
    "parse_spec",
    "trace",
]

FAULTS_ENV = "TIERSTORE_FAULTS"
TRACE_ENV = "TIERSTORE_FAULT_TRACE"
HOOK_DIR = str(Path(__file__).resolve().with_name("_arming"))  # holds the sitecustomize hook


def armed_env(
    specs: str | None = None,
    *,
    trace: str | os.PathLike[str] | None = None,
    sleep: float | None = None,
    block_dir: str | os.PathLike[str] | None = None,
    block_timeout: float | None = None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The variables to add to a child's environment so that it starts armed with ``specs``
    and traces to ``trace``; ``sleep``, ``block_dir`` and ``block_timeout`` shape what a
    ``sleep`` or ``block`` action does (docs/operations.md#settings). ``PYTHONPATH`` is
    ``environ``'s with the hook first."""
    if specs:
        parse_spec(specs)  # a bad spec fails here, in the test, not in the child
    path = [HOOK_DIR, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
    for variable, value in (
        (FAULTS_ENV, specs),
        (TRACE_ENV, trace),
        (settings.FAULT_SLEEP.variable, sleep),
        (settings.FAULT_BLOCK_DIR.variable, block_dir),
        (settings.FAULT_BLOCK_TIMEOUT.variable, block_timeout),
    ):
        if value is not None:
            env[variable] = str(value)
    return env


def arm_from_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Arm what ``TIERSTORE_FAULTS`` and ``TIERSTORE_FAULT_TRACE`` say: what the hook runs
    as an armed child starts."""
    for spec in parse_spec(environ.get(FAULTS_ENV, "")):
        arm(spec.pattern, spec.action, hit=spec.hit)
    if environ.get(TRACE_ENV):
        _points.trace(environ[TRACE_ENV])
