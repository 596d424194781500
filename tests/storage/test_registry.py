"""The backend registry: URLs to backends, lazy registration, install hints, a read-only view;
a mistyped URL (``s3:/b/r``) refused by every way in, naming the URL meant, before anything is
created, and local paths with a colon elsewhere kept local (issue 22, item 5).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tierstore import StagingOptions, TieredReader, TieredWriter
from tierstore.errors import BackendNotFound, ConfigError
from tierstore.manager import CheckpointManager
from tierstore.storage import registry
from tierstore.storage.local import LocalBackend
from tierstore.tiers.tier import Tier


def test_plain_paths_and_file_urls_resolve_to_local(tmp_path) -> None:
    assert isinstance(registry.open_backend(str(tmp_path)), LocalBackend)
    assert isinstance(registry.open_backend(tmp_path), LocalBackend)
    b = registry.open_backend(f"file://{tmp_path}", label="hot")
    assert isinstance(b, LocalBackend) and b.label == f"hot file://{tmp_path}"


def test_unknown_scheme_names_the_package_to_install(monkeypatch) -> None:
    registry.registered_backends()  # load entry points, then hide any installed S3 plugin
    monkeypatch.setattr(registry, "_registry", {k: v for k, v in registry._registry.items() if k != "s3"})
    with pytest.raises(BackendNotFound, match="pip install tierstore-s3"):
        registry.open_backend("s3://bucket/run1")
    with pytest.raises(BackendNotFound, match="entry-point group"):
        registry.open_backend("nosuchscheme://bucket/x")


def test_register_backend_conflicts_raise(registered_backend) -> None:
    registered_backend("unit-test", LocalBackend)  # the registry is restored after the test
    registry.register_backend("unit-test", LocalBackend)  # same again: fine
    with pytest.raises(ConfigError, match="already registered"):
        registry.register_backend("unit-test", "somewhere:Else")
    registry.register_backend("unit-test", "somewhere:Else", replace=True)
    with pytest.raises(BackendNotFound, match="failed to import"):
        registry.backend_class("unit-test")
    with pytest.raises(ConfigError):
        registry.register_backend("bad scheme!", LocalBackend)


def test_registered_view_is_read_only() -> None:
    view = registry.registered_backends()
    assert "file" in view
    with pytest.raises(TypeError):
        view["x"] = "y"  # type: ignore[index]


# -- a mistyped tier URL ------------------------------------------------------------------------


MISTYPED = [
    ("s3:/bucket/run", "s3://bucket/run"),
    ("s3:bucket/run", "s3://bucket/run"),
    ("GS:/bucket/run", "GS://bucket/run"),
    ("file:/data/run", "file:///data/run"),
    ("memory:/x", "memory://x"),
    ("fsspec+memory:/x", "fsspec+memory://x"),
    ("https:/host/x", "https://host/x"),
]


@pytest.mark.parametrize(("url", "meant"), MISTYPED)
def test_a_mistyped_url_is_refused_naming_what_was_meant(
    tmp_path: Path, cwd: Path, url: str, meant: str
) -> None:
    hot = str(tmp_path / "hot")
    for build in (
        lambda: CheckpointManager(hot, url, staging=StagingOptions(async_save=False)),
        lambda: TieredWriter(hot, url, step=1),
        lambda: TieredReader(hot, url),
        lambda: TieredWriter(url, step=1),
    ):
        with pytest.raises(ConfigError) as raised:
            build()
        assert url in str(raised.value) and meant in str(raised.value)
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("path", ["/data/run:1", "./a:b", "run:1", "a/s3:/b", "rel/dir", "~/x:y"])
def test_local_paths_with_a_colon_elsewhere_stay_local(cwd: Path, path: str) -> None:
    from tierstore.storage.registry import split_scheme

    assert split_scheme(path) == ("file", path)
    Tier("hot", path).check_scheme()
    assert list(cwd.iterdir()) == []
