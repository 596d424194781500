"""What the README says of the command and of installing it (issue 38, item 5): every command
the parser has, and an install that works while no package index holds a release."""

from __future__ import annotations

import re
from pathlib import Path

from tierstore.cli import COMMANDS

README = Path(__file__).parents[2] / "README.md"


def test_the_readme_names_every_command_of_the_parser() -> None:
    text = README.read_text()
    [listing] = re.findall(r"The `tierstore` command operates a store: (.*?)\(", text, re.S)
    assert set(re.findall(r"`([\w-]+)`", listing)) == set(COMMANDS), listing


def test_the_readme_installs_from_a_checkout_and_says_no_index_holds_a_release() -> None:
    install = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "No package index holds a tierstore release yet" in install
    assert "from the package index" not in install
    assert "pip install -e . -e backends/s3 -e backends/gcs torch==" in install
    assert "make wheels" in install and "--find-links dist" in install
