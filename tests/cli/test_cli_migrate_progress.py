"""`tierstore migrate`'s bar on a big file moves part by part (issue 38, item 3): one 40 MiB
shard to S3 in 5 MiB parts used to show 0% until the whole object was stored, then 100%."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

from helpers import save
from s3_fault_proxy import FaultProxy  # backends/s3/tests, on the path through cold_tiers


def _run_on_a_terminal(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``command`` with its stderr on a pseudo-terminal (tqdm draws its bar there)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    output = bytearray()
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    return proc.wait(timeout=120), output.decode(errors="replace")


def test_migrate_bar_advances_part_by_part(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    hot = str(tmp_path / "hot")
    manifest = save(hot, 1, shape=(2560, 4096)).manifest  # a 40 MiB shard: 9 parts
    assert manifest is not None
    proxy = FaultProxy(s3_endpoint)
    try:
        proxy.add("delay", method="PUT", contains=("partNumber=",), times=100, delay=0.3)
        options = {
            "endpoint_url": proxy.url,
            "key": "testing",
            "secret": "testing",
            "region": "us-west-2",
            "part_size": 5 << 20,
            "max_concurrency": 2,
        }
        command = [
            sys.executable,
            "-m",
            "tierstore",
            "migrate",
            "--hot",
            hot,
            "--cold",
            f"s3://{s3_bucket}/run",
        ]
        command += [f"--cold-option={k}={v}" for k, v in options.items()]
        env = {k: v for k, v in os.environ.items() if k != "TIERSTORE_FAULTS"}
        code, shown = _run_on_a_terminal(command, env)
    finally:
        proxy.close()
    assert code == 0, shown[-2000:]
    percents = [int(p) for p in re.findall(rf"{manifest.name}:\s+(\d+)%", shown)]
    assert percents and percents[-1] == 100, shown[-2000:]
    assert percents == sorted(percents), percents  # never back
    between = {p for p in percents if 5 <= p <= 95}
    assert len(between) >= 3, percents  # the parts as S3 stored them, not 0% then 100%
