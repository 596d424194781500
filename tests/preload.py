"""Rank processes started from a process that has imported torch already (the tests' own
launcher: ``launch.start_rank``).

Every rank of a test job used to pay ``import torch`` and DCP's and FSDP2's modules on its
own: about 3 CPU-seconds a process, most of a short job's time, and most of the suite's CPU
on 2 cores. A *preloader* (``python tests/preload.py SOCKET PARENT``), one per test process, imports
those once and forks a rank for each request, as torch's DataLoader workers and
multiprocessing's forkserver do. The rank is a real process all the same: its own session
(``kill_group`` ends it and its helpers), its own pid, a child of the test process (the
preloader forks twice and the test process adopts the rank: ``PR_SET_CHILD_SUBREAPER``
while it starts one), so ``waitpid``, SIGKILL, exit codes and a signal's ``-N`` are as
``subprocess.Popen`` gives them. It runs the script as ``python script.py`` would: its
directory first on ``sys.path``, the environment and arguments it was given, ``__main__``,
an uncaught exception printed and exit 1, the interpreter's normal end (atexit, threads).

Only ``[sys.executable, script.py, ...]`` commands are preloaded, and only when the
environment agrees with the preloader's on what torch reads as it is imported (``TORCH_*``,
``OMP_*``, ``MKL_*``, ``PYTHON*``); anything else is started by ``subprocess.Popen`` as
before, and so is everything when ``TIERSTORE_TEST_PRELOAD`` is not ``1`` (tests/conftest.py
sets it; the benchmarks, which share the launcher, start ranks as a user's job does). Nothing of tierstore is imported before the fork:
the rank imports it with its own environment (fault points are armed from it).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

_PRELOADED = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp")
_READ_AT_IMPORT = ("TORCH_", "OMP_", "MKL_", "PYTHON", "LD_", "KMP_", "GOMP_")
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1  # the preloader ends with the test process, even one SIGKILLed
_HERE = Path(__file__).resolve()


# --- the preloader (runs as ``python tests/preload.py SOCKET PARENT``) --------------------


def _serve(path: str, test_process: int) -> dict[str, Any]:
    """Accept requests until the test process goes; in a forked rank, return its request."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a rank, forked, has none
    if os.getppid() != test_process:  # the test process was gone before that line
        os._exit(0)
    for module in _PRELOADED:
        __import__(module)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            os._exit(0)
        with conn:
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                os._exit(0)  # the test process is gone
            middle = os.fork()
            if middle == 0:  # forks the rank, tells its pid, and leaves it to the test process
                server.close()
                middle = os.getpid()  # before the fork: the middle may be gone before the rank looks
                rank = os.fork()
                if rank == 0:
                    conn.close()
                    while os.getppid() == middle:  # adopted by the test process before it runs
                        time.sleep(0.001)
                    _become(request, fds)
                    return request
                conn.sendall(struct.pack("!i", rank))
                os._exit(0)
            for fd in fds:
                os.close(fd)
            os.waitpid(middle, 0)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise ValueError("no request")
    (size,) = struct.unpack("!i", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("a request cut short")
        body += chunk
    return json.loads(body), list(fds)


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked rank: a session of its own, the given standard streams, directory,
    environment and arguments, the script's directory first on ``sys.path``."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][1])
    sys.argv = [script, *request["argv"][2:]]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *[p for p in sys.path[1:] if p not in extra]]
    if request["env"].get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()


def _main() -> None:
    request = _serve(sys.argv[1], int(sys.argv[2]))
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")  # an exception ends it as python would
    del request


# --- the test process's side --------------------------------------------------------------


class Rank:
    """The part of ``subprocess.Popen`` the tests use, for a rank the preloader forked."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, args: Sequence[str]) -> None:
        self.pid, self.stdout, self.args = pid, stdout, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: it is over, how is not known
            self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[bytes | None, None]:
        out = self.stdout.read() if self.stdout is not None else None
        self.wait(timeout)
        return out, None


class _Preloader:
    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="tierstore-preload-"), "socket")
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(_HERE), self.path, str(os.getpid())],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            self.proc.kill()
            raise OSError("the preloader did not start")
        self.lock = threading.Lock()
        atexit.register(self.close)

    def agrees(self, env: Mapping[str, str]) -> bool:
        def read_at_import(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(_READ_AT_IMPORT) and k != "PYTHONFAULTHANDLER"}

        return read_at_import(env) == read_at_import(self.env)

    def start(self, command: Sequence[str], env: Mapping[str, str], cwd: str, fds: list[int]) -> int:
        body = json.dumps({"argv": list(command), "env": dict(env), "cwd": cwd}).encode()
        libc = ctypes.CDLL(None, use_errno=True)
        with self.lock, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            try:
                socket.send_fds(conn, [struct.pack("!i", len(body))], fds)
                conn.sendall(body)
                head = b""
                while len(head) < 4:
                    chunk = conn.recv(4 - len(head))
                    if not chunk:
                        raise OSError("the preloader did not start the rank")
                    head += chunk
                (pid,) = struct.unpack("!i", head)
                deadline = time.monotonic() + 10
                while _parent_of(pid) not in (os.getpid(), None):  # adopted once the middle one exits
                    if time.monotonic() > deadline:
                        raise OSError(f"rank {pid} was not adopted")
                    time.sleep(0.001)
            finally:
                libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        return pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None  # gone already (and adopted before it went: only our child can be reaped)
    return int(stat[stat.rindex(")") + 2 :].split()[1])


_preloader: _Preloader | None = None
_failed = False


def _the_preloader() -> _Preloader | None:
    global _preloader, _failed
    if _preloader is None and not _failed:
        try:
            _preloader = _Preloader()
        except OSError:
            _failed = True
    return _preloader


def preloaded(
    command: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    output: IO[bytes] | int | None,
) -> Rank | None:
    """``command`` started by the preloader, or ``None`` where it cannot be (the caller
    starts it with ``subprocess.Popen``)."""
    if sys.platform != "linux":
        return None
    if len(command) < 2 or command[0] != sys.executable or not str(command[1]).endswith(".py"):
        return None
    preloader = _the_preloader()
    if preloader is None or not preloader.agrees(env):
        return None
    stdin = os.open(os.devnull, os.O_RDONLY)
    reader: IO[bytes] | None = None
    close: list[int] = [stdin]
    if output is None:  # this process's own standard output and error, as Popen leaves them
        out, err = 1, 2
    elif output == subprocess.PIPE:
        read_end, out = os.pipe()
        reader = os.fdopen(read_end, "rb")
        err = out
        close.append(out)
    elif isinstance(output, int):
        out = err = output
    else:
        out = err = output.fileno()
    try:
        pid = preloader.start(
            command, env, os.fspath(cwd) if cwd is not None else os.getcwd(), [stdin, out, err]
        )
    except OSError:
        if reader is not None:
            reader.close()
        for fd in close:
            os.close(fd)
        return None
    for fd in close:
        os.close(fd)
    return Rank(pid, reader, command)


if __name__ == "__main__":
    _main()
