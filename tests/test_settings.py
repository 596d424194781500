"""Settings in one place (issue 36, item 4): every environment variable tierstore reads is
read by tierstore.settings and listed in docs/operations.md's one table, with its default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierstore import settings
from tierstore.dcp import writer
from tierstore.errors import ConfigError
from tierstore.format import manifest_format
from tierstore.migration import workers
from tierstore.tiers import runlock

ROOT = Path(__file__).resolve().parents[1]


def documented() -> dict[str, str]:
    """variable -> default, from the table of docs/operations.md's Settings section."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(TIERSTORE_\w+)` \| ([^|]+) \|", section, re.MULTILINE)
    return {variable: default.strip().strip("`") for variable, default in rows}


def test_the_defaults_documented_are_the_ones_the_code_uses() -> None:
    assert int(settings.MANIFEST_PART_RANKS.default) == manifest_format.PART_RANKS
    assert int(settings.MAX_FILES_PER_DIR.default) == writer.MAX_FILES_PER_DIR
    assert float(settings.RUN_LOCK_TTL.default) == runlock.DEFAULT_TTL
    assert float(settings.EXIT_WAIT.default) == workers.EXIT_WAIT


def test_a_setting_is_read_when_used_and_a_bad_one_names_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(settings.EXIT_WAIT.variable, raising=False)
    assert settings.read(settings.EXIT_WAIT) is None
    assert settings.seconds(settings.EXIT_WAIT) == 30.0
    monkeypatch.setenv(settings.EXIT_WAIT.variable, " 4.5 ")
    assert settings.seconds(settings.EXIT_WAIT) == 4.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(settings.EXIT_WAIT.variable, bad)
        with pytest.raises(ConfigError, match="TIERSTORE_EXIT_WAIT"):
            settings.seconds(settings.EXIT_WAIT)


def test_a_variable_not_in_the_table_is_never_read() -> None:
    with pytest.raises(KeyError):
        settings.read("TIERSTORE_SOMETHING_UNLISTED")


def test_the_run_lock_ttl_and_the_exit_wait_come_through_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_RUN_LOCK_TTL", "7")
    assert runlock._ttl(None) == 7.0
    assert runlock._ttl(3) == 3.0  # an argument wins
    monkeypatch.setenv("TIERSTORE_EXIT_WAIT", "3")
    assert workers.exit_wait() == 3.0


def test_no_module_but_settings_reads_a_tierstore_variable() -> None:
    """The library's own variables are read in tierstore/settings.py alone (the arming hook
    of tierstore.testing reads the fault specs, for tests only)."""
    package = ROOT / "tierstore"
    readers = []
    for path in package.rglob("*.py"):
        if path == package / "settings.py" or package / "testing" in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ|getenv", line) and re.search(r"TIERSTORE|_ENV\b", line):
                readers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert readers == []


def test_the_fault_specs_are_documented_as_read_by_the_test_hook_alone() -> None:
    from tierstore.testing import faults

    table = documented()
    for variable in (faults.FAULTS_ENV, faults.TRACE_ENV):
        assert table.pop(variable) == "(none)"
    assert table == {s.variable: s.default for s in settings.SETTINGS}
