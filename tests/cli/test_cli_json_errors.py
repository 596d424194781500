"""The `tierstore` command's errors (issue 38, item 5): under ``--json`` each is one JSON object
on stderr (stdout holds results only), naming its type, message, exit code and, where the error
carries them, the tier, checkpoint or file; a tier URL that no installed backend serves
(mistyped, unknown scheme, plugin missing or broken) is a usage error, exit 2. A mistyped cold
URL (``s3:/b/r``) names the URL meant and creates nothing, not even for ``migrate``, which
creates a missing cold tier (issue 22, item 5)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import save

from tierstore.cli import COMMANDS, main
from tierstore.format import layout
from tierstore.storage import registry


@pytest.fixture(autouse=True)
def _sigint_kept() -> Iterator[None]:
    """main() installs its Ctrl-C handler (and ignores SIGINT once interrupted): put back
    pytest's."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def hot(tmp_path: Path) -> str:
    path = str(tmp_path / "hot")
    save(path, 1)
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def json_error(capsys: pytest.CaptureFixture[str], code: int, *args: str) -> dict[str, Any]:
    """The one JSON object a command run with ``--json`` wrote on stderr, exiting ``code``."""
    got, out, err = run(capsys, *args, "--json")
    assert got == code, (got, out, err)
    [line] = err.splitlines()
    body = json.loads(line)
    assert body["exit_code"] == code and body["message"], body
    return body


def test_under_json_an_error_is_one_json_object_on_stderr_and_stdout_stays_empty(
    hot: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "no-such-store")
    body = json_error(capsys, 1, "ls", "--hot", missing)
    assert body == {
        "error": "CommandFailed",
        "message": f"the hot tier {missing} does not exist",
        "exit_code": 1,
        "command": "ls",
        "tier": f"hot {missing}",
    }
    body = json_error(capsys, 1, "show", "--hot", hot, "--name", "nope")
    assert body["error"] == "CheckpointNotFound" and body["command"] == "show"
    assert body["checkpoint"] == "nope" and body["tier"].startswith("hot ") and "[" not in body["message"]
    body = json_error(capsys, 2, "migrate", "--hot", hot)
    assert (body["error"], body["message"]) == ("UsageError", "--hot and --cold are both required")
    body = json_error(
        capsys, 2, "show", "--hot", hot, "--step", "2", "--name", layout.default_name(1)
    )  # contradicting options, found by the command itself
    assert body["error"] == "UsageError" and "contradict" in body["message"]
    # argparse's own usage errors too, at the top level and in a subcommand
    body = json_error(capsys, 2, "ls", "--hot", hot, "--bogus")
    assert body == {
        "error": "UsageError",
        "message": "unrecognized arguments: --bogus",
        "exit_code": 2,
        "command": "ls",
    }
    body = json_error(capsys, 2, "show", "--hot", hot, "--step", "two")
    assert body["command"] == "show" and "invalid int value: 'two'" in body["message"]
    body = json_error(capsys, 2, "no-such-command")
    assert body["error"] == "UsageError" and body["command"] is None and "invalid choice" in body["message"]


def test_without_json_errors_stay_one_plain_line(hot: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "--hot", hot, "--name", "nope")
    assert code == 1 and not out and err.startswith("tierstore: CheckpointNotFound: ") and "'nope'" in err
    code, out, err = run(capsys, "ls", "--hot", hot, "--bogus")  # argparse's own text
    assert (
        code == 2
        and err.startswith("usage: tierstore ")
        and err.endswith("\ntierstore: error: unrecognized arguments: --bogus\n")
    )
    code, out, err = run(capsys, "show", "--hot", hot, "--step", "two")
    assert (
        code == 2
        and err.startswith("usage: tierstore show ")
        and err.endswith("\ntierstore show: error: argument --step: invalid int value: 'two'\n")
    )


def test_the_cold_tier_down_and_ctrl_c_are_json_under_json(
    hot: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = str(tmp_path / "cold")
    Path(cold).mkdir()
    monkeypatch.setattr("tierstore.cli.inspect.cold_unreachable", lambda tier, wait: "connection refused")
    code, out, err = run(capsys, "ls", "--hot", hot, "--cold", cold, "--json")
    assert code == 1 and [r["migration"] for r in json.loads(out)] == ["unknown"]  # the hot tier, listed
    assert json.loads(err) == {
        "error": "ColdTierUnreachable",
        "message": f"the cold tier {cold} is unreachable (connection refused); showing the hot tier only",
        "exit_code": 1,
        "command": "ls",
        "tier": f"cold {cold}",
    }

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, "verify", interrupted)
    body = json_error(capsys, 130, "verify", "--hot", hot)
    assert body["error"] == "KeyboardInterrupt" and body["command"] == "verify"
    assert body["message"].startswith("interrupted: ") and "run `tierstore verify` again" in body["message"]


@pytest.mark.parametrize(
    ("args", "error", "said"),
    [
        (("ls", "--hot", "s3:/bucket/run"), "ConfigError", "looks like a mistyped s3:// URL"),
        (("ls", "--hot", "{hot}", "--cold", "gs:bucket/run"), "ConfigError", "'gs://bucket/run'"),
        (
            ("ls", "--hot", "nosuch://bucket/run"),
            "BackendNotFound",
            "no tierstore backend for scheme 'nosuch'",
        ),
        (("status", "--hot", "{hot}", "--cold", "azure://c/run"), "BackendNotFound", "'azure'"),
        (
            ("cp", "--hot", "{hot}", "--step", "1", "--to", "nosuch://b/run"),
            "BackendNotFound",
            "scheme 'nosuch'",
        ),
        (("ls", "--hot", "broken://b/run"), "BackendNotFound", "failed to import"),
    ],
)
def test_a_tier_url_no_installed_backend_serves_is_a_usage_error(
    hot: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    error: str,
    said: str,
) -> None:
    # A plugin whose entry point names a module that is not installed: a missing plugin
    registered = dict(registry.registered_backends())  # (entry points loaded first)
    monkeypatch.setattr(registry, "_registry", {**registered, "broken": "tierstore_broken:Backend"})
    args = tuple(a.format(hot=hot) for a in args)
    code, out, err = run(capsys, *args)
    assert code == 2 and not out, (code, err)
    [line] = err.splitlines()
    assert line.startswith(f"tierstore {args[0]}: --") and said in line, line
    body = json_error(capsys, 2, *args)
    assert body["error"] == error and said in body["message"] and body["command"] == args[0], body
    assert body["tier"].split()[0] in ("hot", "cold", "to"), body


def test_the_cli_refuses_a_mistyped_cold_url_and_creates_nothing(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "hot"
    save(str(hot), 1)
    # migrate creates a missing cold tier: it must not create ./s3:/b/r
    assert main(["migrate", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    err = capsys.readouterr().err
    assert "s3:/b/r" in err and "s3://b/r" in err
    assert main(["ls", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    assert "s3:/b/r" in capsys.readouterr().err
    assert list(cwd.iterdir()) == []


def test_the_cli_ls_names_the_meant_url(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    assert main(["ls", "--hot", str(hot), "--cold", "s3:/b/r"]) in (1, 2)
    assert "s3://b/r" in capsys.readouterr().err
