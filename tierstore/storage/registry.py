"""Backends by URL scheme: built-ins, ``register_backend()``, and the ``tierstore.backends``
entry-point group (name = scheme, value = ``"module:Class"``), imported lazily on first use.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

from tierstore._redact import redact_url, scrub, url_secrets
from tierstore.errors import BackendNotFound, ConfigError
from tierstore.storage.backend import Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "register_backend",
    "registered_backends",
    "backend_class",
    "open_backend",
    "split_scheme",
]

ENTRY_POINT_GROUP = "tierstore.backends"

_BUILTINS: dict[str, str] = {
    "file": "tierstore.storage.local:LocalBackend",
    "memory": "tierstore.storage.memory:MemoryBackend",
}
# Schemes whose backend ships as its own distribution: named in the "not found" error.
_KNOWN_PLUGINS: dict[str, str] = {
    "s3": "tierstore-s3",
    "gs": "tierstore-gcs",
    "gcs": "tierstore-gcs",
}

# Schemes a tier URL is likely meant to have although no backend serves them here: a path
# starting with one of them and a colon but no "//" is a mistyped URL (split_scheme).
_WELL_KNOWN = frozenset(
    {
        "file",
        "memory",
        "s3",
        "s3a",
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
        "adl",
        "hdfs",
        "webhdfs",
        "http",
        "https",
        "ftp",
        "sftp",
    }
)

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")  # RFC 3986
_MISTYPED = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):(?P<rest>.*)", re.S)
_registry: dict[str, str | type[Backend]] = dict(_BUILTINS)
_entry_points_loaded = False
_lock = threading.Lock()


def registered_backends() -> Mapping[str, str | type[Backend]]:
    """A read-only view of scheme -> backend class or lazy ``"module:Class"`` string."""
    _load_entry_points()
    return MappingProxyType(_registry)


def register_backend(scheme: str, backend: str | type[Backend], *, replace: bool = False) -> None:
    """Register ``backend`` (a class or ``"module:Class"``) for URLs ``scheme://...``.

    Registering a different backend for a scheme that already has one raises unless
    ``replace=True``; registering the same one again is a no-op.
    """
    if not _SCHEME.fullmatch(scheme.lower()):
        raise ConfigError(f"invalid URL scheme {scheme!r}")
    _load_entry_points()
    with _lock:
        _register(scheme.lower(), backend, replace=replace, source="register_backend()")


def _register(scheme: str, backend: str | type[Backend], *, replace: bool, source: str) -> None:
    current = _registry.get(scheme)
    if current is not None and not replace and _qualname(current) != _qualname(backend):
        raise ConfigError(
            f"scheme {scheme!r} is already registered to {_qualname(current)}; "
            f"{source} asked for {_qualname(backend)} (pass replace=True to override)"
        )
    _registry[scheme] = backend


def _qualname(backend: str | type[Backend]) -> str:
    if isinstance(backend, str):
        return backend
    return f"{backend.__module__}:{backend.__qualname__}"


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            # Importing nothing here: the value stays a lazy "module:Class" string.
            _register(
                ep.name.lower(), ep.value, replace=False, source=f"entry point {ep.name} of {_dist_name(ep)}"
            )
        _entry_points_loaded = True


def _dist_name(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", "an installed distribution")


def backend_class(scheme: str) -> type[Backend]:
    """The backend class for ``scheme``, importing it on first use."""
    scheme = scheme.lower()
    if scheme.startswith("fsspec+"):  # any fsspec filesystem, asked for explicitly
        from tierstore.storage.fsspec_backend import FsspecBackend

        return FsspecBackend
    _load_entry_points()
    target = _registry.get(scheme)
    if target is None:
        hint = _KNOWN_PLUGINS.get(scheme)
        install = (
            f"; install it with `pip install {hint}`"
            if hint
            else (f"; install a plugin that registers it in the {ENTRY_POINT_GROUP!r} entry-point group")
        )
        raise BackendNotFound(f"no tierstore backend for scheme {scheme!r}{install}")
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            hint = _KNOWN_PLUGINS.get(scheme, module_name.split(".")[0])
            raise BackendNotFound(
                f"backend {target} for scheme {scheme!r} failed to import ({err}); "
                f"is `{hint}` installed with its dependencies?"
            ) from err
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigError(f"{target} registered for {scheme!r} is not a tierstore Backend")
        with _lock:
            _registry[scheme] = cls
        return cls
    return target


def split_scheme(url: str | os.PathLike[str]) -> tuple[str, str]:
    """``("s3", "s3://b/p")`` for URLs; ``("file", "/abs/path")`` for plain paths.

    A path that starts like a URL of a known scheme but lacks its ``//`` (``s3:/b/p``,
    ``s3:b/p``) is a :class:`~tierstore.errors.ConfigError` naming the URL it likely is:
    taken as a local directory it would be created in the working directory, reported
    healthy, and the hot tier pruned against it. Paths with a colon anywhere else
    (``/data/run:1``, ``./a:b``) stay paths.
    """
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"not a tier URL or path: {url!r}")
    scheme, sep, _ = text.partition("://")
    if not sep:
        _refuse_mistyped(text)
        return "file", text
    return scheme.lower(), text


def _refuse_mistyped(path: str) -> None:
    match = _MISTYPED.fullmatch(path)
    if match is None:
        return
    scheme, rest = match["scheme"], match["rest"].lstrip("/")
    lowered = scheme.lower()
    if not (
        lowered in _WELL_KNOWN
        or lowered in _KNOWN_PLUGINS
        or lowered.startswith("fsspec+")
        or lowered in registered_backends()
    ):
        return
    meant = f"{scheme}://{'/' if lowered == 'file' else ''}{rest}"
    shown = scrub(path, url_secrets(meant))  # design.md invariant 18
    raise ConfigError(
        f"tier path {shown!r} looks like a mistyped {lowered}:// URL: did you mean "
        f"{redact_url(meant)!r}? (a local directory of that name is './{shown}')"
    )


def open_backend(
    url: str | os.PathLike[str], options: Mapping[str, Any] | None = None, *, label: str | None = None
) -> Backend:
    """Build the backend for ``url`` with its ``options``; ``label`` names it in errors."""
    scheme, text = split_scheme(url)
    backend = backend_class(scheme)(text, **dict(options or {}))
    if label:
        backend.label = f"{label} {redact_url(text)}"
    return backend
