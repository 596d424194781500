"""Credentials out of every URL tierstore shows: reprs, tier labels, errors, logs, CLI output.

A tier URL may carry a password (``fsspec+sftp://user:pw@host/x``) or a secret query value
(``...?token=...``, a pre-signed ``X-Amz-Signature``). Everything that shows a URL passes it
through :func:`redact_url`; the URL itself is kept intact, since backends need it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MASK", "redact_url", "url_secrets", "scrub"]

MASK = "***"

# Any query parameter whose name contains one of these words (case-insensitive) is a secret.
_SECRET_NAME = re.compile(
    r"token|key|secret|signature|sig|password|passwd|pwd|credential|auth", re.IGNORECASE
)
# scheme://authority rest; the authority ends at the first "/", "?" or "#" (RFC 3986 3.2).
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#]*)(?P<rest>.*)", re.S)


def redact_url(url: str) -> str:
    """``url`` with its userinfo password and secret-looking query values replaced by ``***``.

    Chained fsspec URLs (``simplecache::s3://...``) are redacted link by link; a plain path
    is returned unchanged.
    """
    return "::".join(_redact_link(link) for link in url.split("::"))


def url_secrets(url: str) -> list[str]:
    """The secret substrings of ``url`` (passwords, secret query values), longest first."""
    found: set[str] = set()
    for link in url.split("::"):
        match = _URL.fullmatch(link)
        if match is None:
            continue
        userinfo, at, _ = match["authority"].rpartition("@")
        if at and ":" in userinfo:
            found.add(userinfo.partition(":")[2])
        for name, value in _params(match["rest"]):
            if value and _SECRET_NAME.search(name):
                found.add(value)
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def _redact_link(link: str) -> str:
    match = _URL.fullmatch(link)
    if match is None:
        return link
    authority = match["authority"]
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    return match["scheme"] + authority + _redact_rest(match["rest"])


def _redact_rest(rest: str) -> str:
    path, qmark, query = rest.partition("?")
    if not qmark:
        return rest
    query, hash_, fragment = query.partition("#")
    fields = []
    for field in re.split(r"([&;])", query):
        name, eq, _ = field.partition("=")
        fields.append(f"{name}={MASK}" if eq and _SECRET_NAME.search(name) else field)
    return path + qmark + "".join(fields) + hash_ + fragment


def _params(rest: str) -> list[tuple[str, str]]:
    _, qmark, query = rest.partition("?")
    if not qmark:
        return []
    query = query.partition("#")[0]
    return [(f.partition("=")[0], f.partition("=")[2]) for f in re.split(r"[&;]", query) if "=" in f]
