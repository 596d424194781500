"""Configuration: URLs, options, the entry points, and the environment alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierstore.errors import ConfigError, ObjectNotFound, StorageError
from tierstore.storage.registry import backend_class, open_backend
from tierstore_gcs import DEFAULT_PART_SIZE, GCSBackend


def test_entry_points_register_both_schemes() -> None:
    assert backend_class("gs") is GCSBackend
    assert backend_class("gcs") is GCSBackend


def test_environment_alone_is_a_complete_configuration(gcs_bucket: str) -> None:
    # STORAGE_EMULATOR_HOST (set by the gcs_endpoint fixture) and nothing else.
    backend = open_backend(f"gs://{gcs_bucket}/run", label="cold")
    assert backend.part_size == DEFAULT_PART_SIZE
    backend.publish("m/one.json", b"1")
    with backend.open_write("d/file") as out:
        out.write(b"payload")
    again = open_backend(f"gcs://{gcs_bucket}/run/")  # other scheme, trailing slash
    assert again.read_bytes("m/one.json") == b"1"
    assert {i.key: i.size for i in again.list()} == {"m/one.json": 1, "d/file": 7}
    with pytest.raises(ObjectNotFound) as info:
        backend.stat("m/two.json")
    assert "cold gs://" in str(info.value)


def test_environment_alone_in_a_fresh_process(gcs_bucket: str, gcs_endpoint: str) -> None:
    code = (
        "import sys; from tierstore.storage.registry import open_backend\n"
        "b = open_backend(sys.argv[1]); b.publish('k', b'v'); print(b.read_bytes('k').decode())"
    )
    # One variable, nothing else: no options, no credentials, and no
    # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (the tier never takes gcsfs's probing path).
    env = {"PATH": "/usr/bin:/bin", "STORAGE_EMULATOR_HOST": gcs_endpoint}
    done = subprocess.run(
        [sys.executable, "-c", code, f"gs://{gcs_bucket}/p"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "v"


def test_prefixes_keep_tiers_apart(gcs_bucket: str) -> None:
    a = GCSBackend(f"gs://{gcs_bucket}/a")
    ab = GCSBackend(f"gs://{gcs_bucket}/a/b")
    root = GCSBackend(f"gs://{gcs_bucket}")
    ab.publish("x", b"1")
    a.publish("y", b"2")
    GCSBackend(f"gs://{gcs_bucket}/ab").publish("z", b"3")  # shares a's prefix as a string
    assert [i.key for i in a.list()] == ["b/x", "y"]
    assert [i.key for i in ab.list()] == ["x"]
    assert sorted(i.key for i in root.list()) == ["a/b/x", "a/y", "ab/z"]


@pytest.mark.parametrize(
    "url",
    [
        "gs://",
        "gs:///p",
        "gs://Bad_Bucket/p",
        "s3://bucket/p",
        "gs://bucket//p",
        "gs://bucket/a/../b",
        "bucket/p",
    ],
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        GCSBackend(url)


@pytest.mark.parametrize("part_size", [0, 1000, (256 << 10) + 1, -(256 << 10), 1.5])
def test_part_size_must_be_a_multiple_of_256_kib(part_size: object) -> None:
    with pytest.raises(ConfigError, match="256 KiB"):
        GCSBackend("gs://bucket/p", part_size=part_size)  # type: ignore[arg-type]


def test_unknown_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="part_sise"):
        GCSBackend("gs://bucket/p", part_sise=1 << 20)


def test_unusable_token_is_a_config_error_naming_key_and_tier(gcs_bucket: str) -> None:
    backend = GCSBackend(f"gs://{gcs_bucket}/p", token=12345)  # no token gcsfs understands
    with pytest.raises(ConfigError) as info:
        backend.stat("some/key")
    assert info.value.key == "some/key" and backend.label in str(info.value)


def test_gcsfs_options_reach_gcsfs(
    gcs_bucket: str, gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the variable, only the options point the tier at the emulator.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    backend = GCSBackend(
        f"gs://{gcs_bucket}/p",
        endpoint_url=gcs_endpoint,
        token="anon",
        gcsfs_options={"session_kwargs": {"trust_env": False}},
    )
    backend.publish("k", b"v")
    assert backend.read_bytes("k") == b"v"


def test_missing_bucket_is_an_error_not_an_empty_tier(gcs_endpoint: str) -> None:
    backend = GCSBackend("gs://no-such-bucket-here/p")
    for call in (lambda: list(backend.list()), lambda: backend.publish("m", b"x")):
        with pytest.raises(StorageError, match="no such bucket") as info:
            call()
        assert not isinstance(info.value, ObjectNotFound)
