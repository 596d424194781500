"""The documentation's code runs, its install lines agree, and the package shows a clean face.

* Every ```python block of README.md and docs/*.md runs as written (tests/docs_fixtures.py:
  the fixtures for what blocks elide, the example locations, the worker that runs them in a
  real one-rank gloo job against the moto S3 server). A block that needs processes of its own
  (a ``__main__`` guard, a 2-rank trainer: ``LAUNCHED``) runs as the main script of a
  tests/launch.py job instead (tests/docs_job.py). A block not meant to run says so in the
  Markdown with ``<!-- not run: reason -->``.
* ``pip install`` lines take one of two forms everywhere: from the index (``tierstore-s3``)
  or from a checkout (``-e backends/s3``), and a file giving one gives the other.
* Every test file the docs cite exists, and so does every test they name in it.
* ``dir(tierstore)`` is the public API; ``TimeCadence`` and the resume report types have
  reprs a person can read.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import docs_fixtures
import pytest
from docs_fixtures import LAUNCHED, ROOT, SETUPS, Block, Ctx, Launch, doc_files, python_blocks
from launch import JobResult, free_port, run_job, torchrun_env

BLOCKS = [block for path in doc_files() for block in python_blocks(path)]
BLOCK_TIMEOUT = 180  # seconds; a hung block (an un-awaited async save) fails instead of hanging
DOCS_JOB = Path(docs_fixtures.__file__).with_name("docs_job.py")


class Worker:
    """The worker process of tests/docs_fixtures.py: one block at a time, results as JSON lines."""

    def __init__(self, s3_endpoint: str, log: Path) -> None:
        env = {
            **os.environ,
            **torchrun_env(0, 1, free_port()),
            "AWS_ENDPOINT_URL": s3_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-west-2",
        }
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(docs_fixtures.__file__))],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            cwd=ROOT,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # the worker exited

    def run(self, block: Block, tmp: Path, bucket: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        request = {
            "file": block.file,
            "index": block.index,
            "source": block.source,
            "name": f"{block.file}:{block.line}",
            "tmp": str(tmp),
            "bucket": bucket,
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._lines.get(timeout=BLOCK_TIMEOUT)
        except queue.Empty:
            self.close()
            return {"ok": False, "error": f"no answer in {BLOCK_TIMEOUT} s\n{self.tail()}"}
        return json.loads(line) if line else {"ok": False, "error": f"worker died\n{self.tail()}"}

    def tail(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def launch(block: Block, how: Launch, tmp: Path, bucket: str, env: dict[str, str]) -> JobResult:
    """Run a block as the main script of its own job (tests/docs_job.py on each rank), its
    cold tier on the moto server that ``env`` points at."""
    script = tmp / "block.py"  # what __main__.__file__ names: a spawned process imports it
    script.write_text(docs_fixtures.localize(block.source, Ctx(tmp, bucket)))
    request = {
        "file": block.file,
        "index": block.index,
        "name": f"{block.file}:{block.line}",
        "script": str(script),
        "runs": how.runs,
        "tmp": str(tmp),
        "bucket": bucket,
    }
    return run_job(request, how.ranks, env=env, timeout=how.timeout, script=DOCS_JOB)


@pytest.fixture(scope="module")
def worker(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    box = [Worker(s3_endpoint, tmp_path_factory.mktemp("docs-worker") / "worker.log")]
    yield box[0]
    box[0].close()


# -- the blocks ----------------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(
    block: Block, worker: Worker, s3_env: dict[str, str], s3_bucket: str, tmp_path: Path
) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.file}:{block.line} is marked not run: {block.skip}")
    own = LAUNCHED.get((block.file, block.index))
    if own is not None:
        job = launch(block, own, tmp_path, s3_bucket, s3_env)
        assert job.ok, f"{block.file}:{block.line} failed as written:\n{job.describe()}"
        return
    assert worker.proc.poll() is None, f"the worker died before this block:\n{worker.tail()}"
    result = worker.run(block, tmp_path, s3_bucket)
    assert result["ok"], f"{block.file}:{block.line} failed as written:\n{result['error']}"


@pytest.mark.dist
def test_a_block_that_fails_is_reported(worker: Worker, s3_bucket: str, tmp_path: Path) -> None:
    broken = Block("docs/x.md", 0, 1, 'manager.save(1, {"w": 0})\n')  # nothing named manager
    result = worker.run(broken, tmp_path, s3_bucket)
    assert not result["ok"] and "NameError: name 'manager' is not defined" in result["error"]
    assert "docs/x.md:1" in result["error"]  # the traceback names the doc and its line


@pytest.mark.dist
def test_a_launched_block_runs_as_main_and_its_failure_is_reported(
    s3_env: dict[str, str], s3_bucket: str, tmp_path: Path
) -> None:
    source = (
        "import __main__, sys\n"
        "assert __name__ == '__main__' and __main__.__file__.endswith('block.py')\n"
        "print('rank', __import__('os').environ['RANK'], 'ran the block')\n"
        'manager.save(1, {"w": 0})\n'
    )
    job = launch(Block("docs/x.md", 0, 1, source), Launch(ranks=2), tmp_path, s3_bucket, s3_env)
    assert [r.returncode for r in job.ranks] == [1, 1], job.describe()
    for rank in job.ranks:
        assert f"rank {rank.rank} ran the block" in rank.output, job.describe()
        assert "NameError: name 'manager' is not defined" in rank.output, job.describe()
        assert 'File "docs/x.md:1", line 4' in rank.output  # the doc, its line, the block's line


def test_the_docs_have_python_blocks_to_run() -> None:
    files = {b.file for b in BLOCKS}
    assert {
        "README.md",
        "docs/index.md",
        "docs/integrations.md",
        "docs/migration.md",
        "docs/training-state.md",
    } <= files
    assert sum(b.skip is None for b in BLOCKS) >= 18
    # The drop-ins' blocks are runnable code: each runs in processes of its own.
    integrations = [b for b in BLOCKS if b.file == "docs/integrations.md"]
    assert [b.skip for b in integrations] == [None] * 3
    assert all((b.file, b.index) in LAUNCHED for b in integrations)


def test_every_skip_marker_gives_a_reason() -> None:
    unexplained = [f"{b.file}:{b.line}" for b in BLOCKS if b.skip is not None and not b.skip]
    assert not unexplained, f"'<!-- not run: reason -->' without a reason at {unexplained}"


def test_every_setup_names_a_block_that_exists() -> None:
    by_key = {(b.file, b.index): b for b in BLOCKS}
    for key, (first_line, _, _) in SETUPS.items():
        assert key in by_key, f"SETUPS names {key}, which is not a Python block (moved?)"
        assert by_key[key].first_line == first_line, (
            f"{key} now starts with {by_key[key].first_line!r}: update SETUPS in docs_fixtures.py"
        )
        assert by_key[key].skip is None, f"{key} has a setup but is marked not run"
    for key in LAUNCHED:
        assert key in SETUPS, f"LAUNCHED names {key} without a SETUPS entry to guard its index"


def test_the_parser_finds_blocks_markers_and_indented_fences(tmp_path: Path) -> None:
    doc = tmp_path / "sample.md"
    text = (
        "intro\n\n```python\na = 1\n```\n\n<!-- not run: pseudo-code -->\n```python\nb ? 2\n```\n"
        "<!-- not run -->\n\n```py\nc = 3\n```\n- item\n\n   ```python\n   d = 4\n     e = 5\n   ```\n"
        "```sh\npip install x\n```\n<!-- not run: stale -->\n\ntext between\n```python\nf = 6\n```\n"
    )
    doc.write_text(text)
    blocks = python_blocks(doc)
    assert [(b.source, b.skip) for b in blocks] == [
        ("a = 1\n", None),
        ("b ? 2\n", "pseudo-code"),
        ("c = 3\n", ""),
        ("d = 4\n  e = 5\n", None),
        ("f = 6\n", None),
    ]
    assert [b.line for b in blocks] == [3, 8, 13, 18, 28]


def test_example_locations_are_pointed_at_the_run() -> None:
    ctx = docs_fixtures.Ctx(Path("/tmp/x"), "bkt")
    assert (
        docs_fixtures.localize('f("/nvme/run1", "s3://bucket/run1")', ctx)
        == "f('/tmp/x/nvme/run1', 's3://bkt/run1')"
    )
    with pytest.raises(AssertionError, match="/nvme/run1"):
        docs_fixtures.localize("f('/nvme/run1')", ctx)


# -- install lines -------------------------------------------------------------------------------

_PIP = re.compile(r"pip install ((?:-e\s+)?[\w.\-/\[\]]+(?:\s+(?:-e\s+)?[\w.\-/\[\]]+)*)")
INDEX = {"tierstore", "tierstore-s3", "tierstore-gcs"}
CHECKOUT = {"-e .": "tierstore", "-e backends/s3": "tierstore-s3", "-e backends/gcs": "tierstore-gcs"}


def install_files() -> list[Path]:
    return [*doc_files(), *sorted(ROOT.glob("backends/*/README.md"))]


def install_targets(text: str) -> list[str]:
    """What each ``pip install`` line installs: ``-e <dir>`` and distribution names."""
    found = []
    for match in _PIP.finditer(text):
        found += re.findall(r"-e\s+\S+|[^\s]+", match[1])
    return [" ".join(t.split()) for t in found]


def test_install_lines_have_one_form_and_give_both() -> None:
    seen = 0
    for path in install_files():
        targets = install_targets(path.read_text())
        seen += len(targets)
        # Only tierstore's own distributions have two forms; other packages (a framework an
        # integration needs) and pip's flags are not this test's business.
        ours = [t for t in targets if t.startswith(("tierstore", "-e"))]
        odd = [t for t in ours if t not in INDEX and t not in CHECKOUT]
        assert not odd, (
            f"{path.relative_to(ROOT)}: install {odd}; the forms are {sorted(INDEX)} or {sorted(CHECKOUT)}"
        )
        from_index = {t for t in targets if t in INDEX}
        from_checkout = {CHECKOUT[t] for t in targets if t in CHECKOUT}
        assert from_index == from_checkout, (
            f"{path.relative_to(ROOT)}: from the index {sorted(from_index)}, from a checkout "
            f"{sorted(from_checkout)}: say both for each distribution"
        )
    assert seen >= 8


def test_install_targets_parse_both_forms() -> None:
    text = "pip install tierstore tierstore-s3   # x\n`pip install -e . -e backends/s3`"
    assert install_targets(text) == ["tierstore", "tierstore-s3", "-e .", "-e backends/s3"]


def test_checkout_paths_hold_the_distributions_they_name() -> None:
    for target, dist in CHECKOUT.items():
        pyproject = (ROOT / target.removeprefix("-e ") / "pyproject.toml").read_text()
        assert re.search(rf'^name\s*=\s*"{re.escape(dist)}"', pyproject, re.M), (target, dist)


# -- test files the docs cite ----------------------------------------------------------------------

# `tests/dcp/test_x.py`, `crash/test_y.py` (under tests/), `test_z.py`, each maybe `::test_name`
_CITED = re.compile(r"(?<![\w/.*-])((?:[\w*.-]+/)*test_[\w*]+\.py)(?:::([\w*]+))?")


def cited_files(path: str) -> list[Path]:
    """The files a cited path names: from the checkout's root when it starts with ``tests/``,
    ``backends/`` or ``examples/``, else under tests/; a bare name anywhere under tests/ or
    a backend's tests/."""
    if path.startswith(("tests/", "backends/", "examples/")):
        return sorted(ROOT.glob(path))
    if "/" in path:
        return sorted((ROOT / "tests").glob(path))
    return sorted([*(ROOT / "tests").rglob(path), *ROOT.glob(f"backends/*/tests/{path}")])


def test_the_test_files_the_docs_cite_exist() -> None:
    seen, wrong = 0, []
    for doc in doc_files():
        for match in _CITED.finditer(doc.read_text()):
            seen += 1
            where, name = f"{doc.relative_to(ROOT)}: {match[0]}", match[2]
            files = cited_files(match[1])
            if len(files) != 1 and "*" not in match[1]:
                wrong.append(f"{where} names {len(files)} files")
            elif not files:
                wrong.append(f"{where} names no file")
            elif name:
                word = re.escape(name).replace(r"\*", r"\w*")
                defined = re.compile(rf"^\s*(?:def|class) {word}\b", re.M)
                if not any(defined.search(f.read_text()) for f in files):
                    wrong.append(f"{where}: no {name} there")
    assert not wrong, "\n".join(wrong)
    assert seen >= 100


# -- the package's face ----------------------------------------------------------------------------


def test_dir_lists_the_public_api_and_nothing_else() -> None:
    import tierstore

    listed = dir(tierstore)
    assert set(listed) == set(tierstore.__all__)
    assert {"TieredWriter", "TieredReader", "CheckpointManager", "TrainingState"} <= set(listed)
    for internal in ("importlib", "TYPE_CHECKING", "annotations", "sys", "Any", "_LAZY"):
        assert internal not in listed
    for name in listed:
        assert getattr(tierstore, name) is not None


def test_time_cadence_repr() -> None:
    from tierstore.resume.cadence import TimeCadence

    plain = TimeCadence(600, clock=lambda: 0.0, check_every=10)
    assert repr(plain) == "TimeCadence(interval=600.0, check_every=10, saves=0)"
    planned = TimeCadence.from_failure_rate(
        nodes=64, mtbf_node=30 * 86400, stall=15.0, clock=lambda: 0.0, distributed=False
    )
    text = repr(planned)
    assert text.startswith(f"TimeCadence(interval={planned.interval:.1f}, check_every=1, saves=0, ")
    assert "nodes=64" in text and "mtbf_node=2592000" in text and "method='daly'" in text
    assert " at 0x" not in text


def test_resume_report_reprs() -> None:
    from tierstore.resume.report import Mismatch, ResumeReport

    mismatch = Mismatch("train.optim.state.0.exp_avg", "optimizer", "differ from the live state", (0, 1))
    assert repr(mismatch) == (
        "Mismatch(key='train.optim.state.0.exp_avg', part='optimizer', "
        "problem='differ from the live state', ranks=(0, 1))"
    )
    many = tuple(
        Mismatch(f"train.model.w{i}", "model", "missing from the checkpoint", (0,)) for i in range(50)
    )
    report = ResumeReport(
        "step-0000000003",
        2,
        (4.25, 4.5),
        (4.25, 4.5),
        mismatches=(mismatch, *many),
        keys_checked=120,
        seconds=3.2,
    )
    text = repr(report)
    assert text == (
        "ResumeReport(checkpoint='step-0000000003', ok=False, world_size=2, "
        "keys_checked=120, mismatches=51 (model, optimizer), errors=0, "
        "loss_before=(4.25, 4.5), loss_after=(4.25, 4.5))"
    )
    good = ResumeReport("step-0000000004", 1, (1.0,), (1.0,), keys_checked=9)
    assert repr(good).startswith("ResumeReport(checkpoint='step-0000000004', ok=True, ")
    assert "mismatches=0, errors=0" in repr(good)
