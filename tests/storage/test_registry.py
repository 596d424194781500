"""The backend registry: URLs to backends, lazy registration, install hints, a read-only view."""

from __future__ import annotations

import pytest

from tierstore.errors import BackendNotFound, ConfigError
from tierstore.storage import registry
from tierstore.storage.local import LocalBackend


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
