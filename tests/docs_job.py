"""One rank of a documentation block that runs in processes of its own (tests/docs_fixtures.py,
``LAUNCHED``): ``python tests/docs_job.py REQUEST``, started by tests/launch.py's ``run_job``
as torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT set; no process group yet).

The block runs as this interpreter's ``__main__`` module (``docs_fixtures.run_as_main``). The
rank exits 0 when the block and its check passed; else it prints the traceback, which names
the doc and the line, and exits 1 at once (a peer blocked in a collective is the launcher's to
stop).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: docs_fixtures, launch

import docs_fixtures
from launch import leave_cleanly


def main() -> None:
    request = json.loads(sys.argv[1])
    try:
        docs_fixtures.run_as_main(request)
    except BaseException:  # DCP's CheckpointException is a BaseException
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():  # a trainer's group, or the setup's (torchtitan's trainer makes one)
        leave_cleanly()


if __name__ == "__main__":
    main()
