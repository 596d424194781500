"""No secret of a tier URL in anything we show: repr, labels, errors, logs, CLI output."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import unwrap

from tierstore import TieredReader, TieredWriter
from tierstore.errors import TierstoreError
from tierstore.format import layout
from tierstore.tiers.tier import Tier

SECRET = "Sup3rS3cretPw"
TOKEN = "tok-8f2e1c"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"fsspec+sftp://alice:{SECRET}@host/x", "fsspec+sftp://alice:***@host/x"),
        (f"s3://b/p?token={TOKEN}&region=eu", "s3://b/p?token=***&region=eu"),
        (
            f"https://h/p?X-Amz-Signature={TOKEN}&X-Amz-Credential=AKIA#frag",
            "https://h/p?X-Amz-Signature=***&X-Amz-Credential=***#frag",
        ),
        (
            f"fsspec+simplecache::s3://k:{SECRET}@b/x?sig={TOKEN}",
            "fsspec+simplecache::s3://k:***@b/x?sig=***",
        ),
        (f"gs://b/p?access_key={TOKEN};password={SECRET}", "gs://b/p?access_key=***;password=***"),
        ("sftp://alice@host/run@v2", "sftp://alice@host/run@v2"),
        ("/plain/path:with@signs", "/plain/path:with@signs"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    from tierstore._redact import redact_url

    assert redact_url(url) == shown


@pytest.fixture
def secret_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    # fsspec's file protocol keeps userinfo in the (relative) path: an offline store whose
    # URL carries a password, readable from another process too.
    monkeypatch.chdir(tmp_path)
    url = f"fsspec+file://user:{SECRET}@/store?token={TOKEN}"
    dcp.save({"w": torch.ones(3), "extra": {"step": 1}}, storage_writer=TieredWriter(url, step=1))
    return url


def _clean(text: str) -> None:
    assert SECRET not in text and TOKEN not in text, text


def test_repr_label_and_checkpoint_id(secret_url: str) -> None:
    tier = Tier("cold", secret_url)
    _clean(repr(tier))
    _clean(tier.label)
    _clean(repr(tier.backend) + tier.backend.label)
    assert tier.label == "cold fsspec+file://user:***@/store?token=***"
    _clean(TieredReader(secret_url).checkpoint_id)
    _clean(TieredWriter(secret_url, step=2).checkpoint_id)


def test_errors_and_logs_of_a_failing_read(
    secret_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    hot = f"fsspec+memory://user:{SECRET}@/empty-{os.getpid()}"
    reader = TieredReader(hot, secret_url)
    # The cold copy's data file vanishes: the read fails, naming the cold tier.
    shard = next(Path(tmp_path).rglob("__0_0.distcp"))
    shard.unlink()
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(3), "extra": {"step": 0}}, storage_reader=reader)
    err = unwrap(info.value)
    assert isinstance(err, TierstoreError) and "user:***@" in str(err), err
    _clean(str(err) + repr(err) + str(info.value))
    with pytest.raises(TierstoreError) as missing:
        Tier("hot", hot).backend.read_bytes("no/such/key")
    _clean(str(missing.value))
    # Ours and DCP's (which logs our checkpoint_id); fsspec's debug log is its own business.
    ours = [r for r in caplog.records if r.name.startswith(("tierstore", "c10d", "torch"))]
    assert ours, "expected log records from the failed load"
    for record in ours:
        _clean(record.getMessage())


def test_cli_output(secret_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    outputs = []
    for args in (
        ["ls"],
        ["show"],
        ["show", "--name", "nope"],
        ["verify"],
        ["status", "--cold", secret_url],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "tierstore", *args, "--hot", secret_url],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        outputs.append(run.stdout + run.stderr)
        _clean(run.stdout + run.stderr)
    assert layout.default_name(1) in outputs[0]  # ls really listed the store
    assert "user:***@" in outputs[1] + outputs[2], outputs  # show names the tiers, redacted
