"""The `tierstore` command as a new user meets it (issue 16, items 1-4), in real subprocesses:
help and version, exit codes, wrong input refused, a cold tier that is down, Ctrl-C, progress."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
import textwrap
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import save

from tierstore import Store, list_checkpoints
from tierstore.cli import COMMANDS
from tierstore.cli.parser import build_parser
from tierstore.format import layout
from tierstore.testing.faults import armed_env

BIG = (1024, 1024)  # 4 MiB a checkpoint: seconds to copy at --bandwidth 1
DOCS = Path(__file__).parents[2] / "docs" / "operations.md"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The single stderr line of a command that exited ``code``, naming ``words``."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


@pytest.fixture
def hot(tmp_path: Path) -> str:
    path = str(tmp_path / "hot")
    for step in (1, 2):
        save(path, step)
    return path


def test_version_help_examples_and_exit_codes_are_shown() -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"tierstore {version('tierstore')}"
    top = cli("--help")
    assert top.returncode == 0
    for name in COMMANDS:  # each subcommand listed with a description after its name
        assert re.search(rf"^\s+{re.escape(name)}\s+\S", top.stdout, re.M) or re.search(
            rf"^\s+{re.escape(name)}\n\s+\S", top.stdout, re.M
        ), name
        sub = cli(name, "--help")
        assert sub.returncode == 0, sub.stderr
        tail = sub.stdout.split("example:\n", 1)[1]
        assert tail.lstrip().startswith(f"tierstore {name} --hot")
        assert re.search(
            r"exit codes:\n\s+0 +success\n\s+1 +\S.*\n\s+2 +usage error\n\s+130 +interrupted", tail
        ), tail
    # Every option of every subcommand has help text.
    for name, parser in subcommands().items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings)


def test_the_cli_reference_lists_every_command_and_option() -> None:
    text = DOCS.read_text()
    reference = text.split("## Command reference", 1)[1].split("\n## ", 1)[0]
    for name, parser in subcommands().items():
        section = reference.split(f"### `tierstore {name}`", 1)[1].split("\n### ", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in section or option in _common(reference), (name, option)
    for code in ("`0`", "`1`", "`2`", "`130`"):
        assert code in reference


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser(COMMANDS)._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _common(reference: str) -> str:
    return reference.split("### ", 1)[0]  # the options every command takes, listed once


def test_usage_errors_exit_2_with_one_line(hot: str) -> None:
    one_line(cli("ls"), 2, "--hot")
    one_line(cli("migrate", "--hot", hot), 2, "--hot and --cold")
    one_line(cli("status", "--cold", hot), 2, "--hot and --cold")
    one_line(cli("prune", "--hot", hot), 2, "give a policy")
    one_line(cli("ls", "--hot", hot, "--hot-option", "fsync"), 2, "not KEY=VALUE")
    one_line(
        cli("show", "--hot", hot, "--step", "2", "--name", layout.default_name(1)),
        2,
        "contradict",
        layout.default_name(1),
        "step 1",
    )
    assert cli("show", "--hot", hot, "--step", "1", "--name", layout.default_name(1)).returncode == 0
    assert cli("ls", "--hot", hot, "--bogus").returncode == 2  # argparse's own


def test_wrong_input_is_an_error_not_an_empty_success(hot: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-store")
    for command in ("ls", "show", "verify", "gc", "prune --hot-keep-last 1"):
        one_line(cli(*command.split(), "--hot", missing), 1, "hot tier", missing, "does not exist")
    one_line(cli("status", "--hot", hot, "--cold", missing), 1, "cold tier", missing, "does not exist")
    one_line(cli("restore", "--hot", hot, "--cold", missing), 1, "cold tier", "does not exist")
    one_line(cli("ls", "--hot", hot, "--cold", f"file://{missing}"), 1, "does not exist")
    one_line(cli("show", "--hot", hot, "--name", "nope"), 1, "CheckpointNotFound", "nope")
    one_line(cli("show", "--hot", hot, "--step", "9"), 1, "CheckpointNotFound", "step 9")
    one_line(cli("verify", "--hot", hot, "--name", "nope"), 1, "CheckpointNotFound", "nope")
    cold = str(tmp_path / "cold")  # migrate creates its cold tier, so it may be missing
    one_line(cli("migrate", "--hot", hot, "--cold", cold, "--name", "nope"), 1, "CheckpointNotFound")
    proc = cli("migrate", "--hot", hot, "--cold", cold, "--name", layout.default_name(2))
    assert proc.returncode == 0 and f"{layout.default_name(2)}: committed" in proc.stdout
    one_line(cli("restore", "--hot", hot, "--cold", cold, "--step", "1"), 1, "CheckpointNotFound", "step 1")


def test_status_exits_1_once_a_migration_failed(hot: str, tmp_path: Path) -> None:
    cold, rival = str(tmp_path / "cold"), str(tmp_path / "rival")
    save(rival, 1)  # another job's step 1 reaches the cold tier first
    assert cli("migrate", "--hot", rival, "--cold", cold).returncode == 0
    proc = cli("migrate", "--hot", hot, "--cold", cold)
    assert proc.returncode == 1 and f"{layout.default_name(1)}: failed" in proc.stdout
    status = cli("status", "--hot", hot, "--cold", cold)
    assert status.returncode == 1 and re.search(rf"{layout.default_name(1)}\s+failed", status.stdout)
    assert re.search(rf"{layout.default_name(2)}\s+committed", status.stdout)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ls_and_status_show_the_hot_tier_when_the_cold_tier_is_down(hot: str) -> None:
    pytest.importorskip("tierstore_s3", reason="the S3 backend is installed by make test")
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
    }
    tiers = ("--hot", hot, "--cold", "s3://bucket/run")
    names = [layout.default_name(s) for s in (1, 2)]
    ls = cli("ls", *tiers, env=env)  # the default wait
    one_line(ls, 1, "cold tier s3://bucket/run is unreachable", "showing the hot tier only")
    assert all(re.search(rf"{n}\s+\d+.*hot\s+(?:[0-9a-f]{{8}}\s+)?unknown", ls.stdout) for n in names), (
        ls.stdout
    )
    rows = json.loads(one_and_out(cli("ls", *tiers, "--json", "--cold-wait", "1", env=env)))
    assert [(r["name"], r["tiers"], r["migration"]) for r in rows] == [(n, ["hot"], "unknown") for n in names]
    status = cli("status", *tiers, "--cold-wait", "1", env=env)
    one_line(status, 1, "unreachable")
    assert all(re.search(rf"{n}\s+unknown", status.stdout) for n in names), status.stdout
    body = json.loads(one_and_out(cli("status", *tiers, "--json", "--cold-wait", "1", env=env)))
    assert [(s["name"], s["state"]) for s in body] == [(n, "unknown") for n in names]


def one_and_out(proc: subprocess.CompletedProcess[str]) -> str:
    one_line(proc, 1, "unreachable")
    return proc.stdout


def _interrupt_when(proc: subprocess.Popen[str], seen: str) -> list[str]:
    """SIGINT ``proc`` once its stderr shows ``seen``; the stderr lines read until then."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if seen in line:
            proc.send_signal(signal.SIGINT)
            return lines
    pytest.fail(f"never saw {seen!r}: {lines}")


def test_ctrl_c_mid_migrate_then_the_rerun_finishes(tmp_path: Path) -> None:
    hot, cold = str(tmp_path / "hot"), str(tmp_path / "cold")
    names = [layout.default_name(s) for s in (1, 2, 3)]
    for step in (1, 2, 3):
        save(hot, step, shape=BIG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "migrate", "--hot", hot, "--cold", cold, "--bandwidth", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    progress = _interrupt_when(proc, f"{names[0]}: 100%")
    out, err = proc.communicate(timeout=60)  # a hang detector, not a timing assertion
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "\r" not in "".join(progress) + err
    assert re.match(rf"{names[0]}: 100% \S+B/\S+B \[.*B/s\]$", progress[-1].strip()), progress
    [line] = err.splitlines()  # the one line, after nothing but progress lines
    assert line.startswith("tierstore migrate: interrupted: uploaded ")
    assert "run the same `tierstore migrate` again to finish" in line
    # The throttle holds each further checkpoint 4 s at 1 MiB/s: step 3 cannot be committed yet.
    assert [c.step for c in list_checkpoints(Store(cold=cold))] != [1, 2, 3]

    again = cli("migrate", "--hot", hot, "--cold", cold, "--json")
    assert again.returncode == 0 and again.stderr == "", again.stderr  # --json: no progress at all
    assert {r["name"] for r in json.loads(again.stdout)} <= set(names)
    assert all(r["state"] == "committed" for r in json.loads(again.stdout))
    assert all(Path(cold, layout.manifest_key(n)).is_file() for n in names)
    assert [c.step for c in list_checkpoints(Store(cold=cold))] == [1, 2, 3]
    verify = cli("verify", "--hot", hot, "--cold", cold)
    assert verify.returncode == 0 and "12 ok, 0 damaged" in verify.stdout


def test_ctrl_c_mid_restore_then_the_rerun_finishes(tmp_path: Path) -> None:
    source, cold, hot = (str(tmp_path / d) for d in ("source", "cold", "hot"))
    gates = tmp_path / "gates"
    gates.mkdir()
    save(source, 1, shape=BIG)
    assert cli("migrate", "--hot", source, "--cold", cold).returncode == 0
    env = {**os.environ, **armed_env("transfer.after_chunk=block", block_dir=gates)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "restore", "--hot", hot, "--cold", cold],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    while not list(gates.glob("transfer.after_chunk.*.reached")) and proc.poll() is None:
        time.sleep(0.05)  # polls the gate file; no time is asserted
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    one_line(
        subprocess.CompletedProcess(proc.args, 130, out, err),
        130,
        "tierstore restore: interrupted: copied",
        "run the same `tierstore restore` again",
    )
    assert list_checkpoints(hot) == []  # nothing half-restored is listed
    again = cli("restore", "--hot", hot, "--cold", cold)
    assert again.returncode == 0 and f"restored {layout.default_name(1)}" in again.stdout
    assert cli("verify", "--hot", hot).returncode == 0


def test_progress_on_a_terminal_is_a_tqdm_bar(hot: str) -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "verify", "--hot", hot],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "4 ok, 0 damaged" in out
    text = shown.decode()
    assert "\r" in text  # redrawn in place
    for step in (1, 2):  # one bar left per checkpoint copy, with bytes, rate and ETA
        assert re.search(
            rf"hot {layout.default_name(step)}: 100%\|[^|]*\| \S+B/\S+B \[\d+:\d+<\d+:\d+, .*B/s\]", text
        ), text


SWALLOWED = textwrap.dedent("""
    import gc, os, signal, sys, threading, time
    import tierstore.cli as cli

    class Finalized:
        def __del__(self):  # the Ctrl-C lands while the main thread runs this finalizer
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            time.sleep(0.3)

    def command(args):
        Finalized()  # collected at once: its __del__ runs in the main thread
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("ran to the end", flush=True)
        return 0

    cli.COMMANDS["verify"] = command
    sys.exit(cli.main(["verify", "--hot", sys.argv[1]]))
""")


def test_a_ctrl_c_python_drops_in_a_finalizer_still_interrupts_the_command(hot: str) -> None:
    # Python ignores a KeyboardInterrupt raised inside __del__ ("Exception ignored in ..."):
    # the CLI raises it again until one is caught.
    done = subprocess.run([sys.executable, "-c", SWALLOWED, hot], capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in done.stderr  # the first one was dropped, as Python does
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert "ran to the end" not in done.stdout
    assert "tierstore verify: interrupted" in done.stderr
