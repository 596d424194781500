"""Checks the ``tierstore`` command makes on its tiers before it trusts an answer.

A tier URL that no installed backend serves (mistyped, an unknown scheme, a plugin missing or
broken) is a usage error, found before anything runs. A local tier path that does not exist
is refused: read as an empty store it would make a typo "succeed". A cold tier that does not
answer within a few seconds is reported as unreachable, so that ``ls`` and ``status`` can
still show the hot tier.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from tierstore._redact import redact_url
from tierstore.cli.parser import UsageError
from tierstore.errors import ConfigError
from tierstore.migration.delivery import unreachable
from tierstore.storage.registry import backend_class, split_scheme
from tierstore.tiers.tier import Tier

__all__ = ["CommandFailed", "require_backends", "require_tiers", "cold_unreachable"]


class CommandFailed(Exception):
    """A one-line failure the command found itself (exit 1); ``where`` names the tier it is
    about (shown under ``--json``)."""

    def __init__(self, message: str, **where: str) -> None:
        super().__init__(message)
        self.where = where


def require_backends(urls: dict[str, str | None]) -> None:
    """Refuse, as a usage error naming its option, a tier URL (by option name) that is mistyped
    (``s3:/b/r``) or that no installed backend serves; the backend's class is imported here,
    so a plugin that is missing or fails to import is found before anything runs."""
    for option, url in urls.items():
        if url is None:
            continue
        try:
            backend_class(split_scheme(url)[0])
        except ConfigError as err:
            raise UsageError(
                f"--{option}: {err}", error=type(err).__name__, tier=f"{option} {redact_url(url)}"
            ) from None


def _local_path(url: str) -> str | None:
    """The directory of a local tier URL, ``None`` for any other scheme."""
    if "://" not in url:
        split_scheme(url)  # a mistyped URL (s3:/b/r) is named as such, not "does not exist"
        return os.path.expanduser(url)
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else None


def require_tiers(urls: dict[str, str | None], creates: str | None) -> None:
    """Refuse a local tier path (by role) that is not a directory, except the role
    ``creates``: the tier the command is about to write into."""
    for role, url in urls.items():
        path = None if url is None else _local_path(url)
        if url is not None and path is not None and role != creates and not os.path.isdir(path):
            raise CommandFailed(
                f"the {role} tier {redact_url(url)} does not exist", tier=f"{role} {redact_url(url)}"
            )


def cold_unreachable(cold: Tier | None, wait: float) -> str | None:
    """Why the cold tier cannot be listed within ``wait`` seconds; ``None`` if it can
    (:func:`tierstore.migration.delivery.unreachable`)."""
    return None if cold is None else unreachable(cold, wait)
