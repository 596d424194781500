"""Checks the ``tierstore`` command makes on its tiers before it trusts an answer.

A local tier path that does not exist is refused: read as an empty store it would make a
typo "succeed". A cold tier that does not answer within a few seconds is reported as
unreachable, so that ``ls`` and ``status`` can still show the hot tier.
"""

from __future__ import annotations

import logging
import os
import threading
from urllib.parse import unquote, urlparse

from tierstore._redact import redact_url
from tierstore.commit import layout
from tierstore.errors import StorageError, TierstoreError
from tierstore.storage.registry import split_scheme
from tierstore.tiers.tier import Tier

__all__ = ["CommandFailed", "require_tiers", "cold_unreachable"]

_PROBE_THREAD = "tierstore-cold-probe"


class CommandFailed(Exception):
    """A one-line failure the command found itself (exit 1)."""


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
            raise CommandFailed(f"the {role} tier {redact_url(url)} does not exist")


class _ProbeRetries(logging.Filter):
    """Keeps the probe's retry warnings off the terminal, remembering the last error: the
    outcome is reported in one line (a probe left behind may retry long after)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName != _PROBE_THREAD:
            return True
        error = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        if isinstance(error, BaseException):
            self.last = error.message if isinstance(error, TierstoreError) else str(error)
        return False


def cold_unreachable(cold: Tier | None, wait: float) -> str | None:
    """Why the cold tier cannot be listed within ``wait`` seconds; ``None`` if it can.

    The listing runs on a daemon thread, left behind if it has not returned by then: a
    backend's own retries and timeouts (minutes, for S3) suit a training job, not an
    operator at a prompt. Errors other than storage errors (a bad URL or option) are
    the user's to fix and are raised.
    """
    if cold is None:
        return None
    box: dict[str, BaseException | bool] = {}

    def probe() -> None:
        try:
            next(iter(cold.backend.list(layout.manifests_prefix())), None)
            box["ok"] = True
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    retries = _ProbeRetries()
    logging.getLogger("tierstore.retry").addFilter(retries)
    thread = threading.Thread(target=probe, name=_PROBE_THREAD, daemon=True)
    thread.start()
    thread.join(wait)
    error = box.get("error")
    if isinstance(error, StorageError):
        return f"{type(error).__name__}: {error.message}"
    if isinstance(error, BaseException):
        raise error
    if box.get("ok"):
        return None
    return f"no answer within {wait:g} s" + (f"; last error: {retries.last}" if retries.last else "")
