"""scripts/import_cycles.py, which make lint runs: it finds the cycles it is there for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_cycles.py"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *flags, str(root)], capture_output=True, text=True)


def test_this_repository_has_no_cycle() -> None:
    done = run(SCRIPT.parent.parent, "--lazy")
    assert done.returncode == 0, done.stdout
    assert "0 file cycle(s), 0 folder cycle(s)" in done.stdout


def test_a_file_cycle_through_a_function_import_counts_only_with_lazy(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "tierstore/__init__.py": "",
            "tierstore/tiers/__init__.py": "",
            "tierstore/tiers/a.py": "from tierstore.tiers import b\n",
            "tierstore/tiers/b.py": "def f():\n    from tierstore.tiers import a\n",
        },
    )
    assert run(root).returncode == 0
    lazy = run(root, "--lazy")
    assert lazy.returncode == 1
    assert "file cycle: tierstore.tiers.a <-> tierstore.tiers.b" in lazy.stdout


def test_a_folder_cycle_and_type_checking_imports(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "tierstore/__init__.py": "",
            "tierstore/low/__init__.py": "",
            "tierstore/high/__init__.py": "",
            "tierstore/low/x.py": "from tierstore.high import y\n",
            "tierstore/high/y.py": "",
            "tierstore/high/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tierstore.low import x\n",
        },
    )
    assert run(root, "--lazy").returncode == 0  # z's import runs only under a type checker
    (root / "tierstore/high/z.py").write_text("from tierstore.low import x\n")
    done = run(root)
    assert done.returncode == 1
    assert "folder cycle: tierstore.high <-> tierstore.low" in done.stdout
