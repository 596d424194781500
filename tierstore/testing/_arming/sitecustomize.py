"""tierstore's fault-arming hook, run as an interpreter starts when a test put this directory
first on ``PYTHONPATH`` (:func:`tierstore.testing.faults.armed_env`); nothing else runs it."""

import os

if os.environ.get("TIERSTORE_FAULTS") or os.environ.get("TIERSTORE_FAULT_TRACE"):
    from tierstore.testing.faults import arm_from_environment

    arm_from_environment()
