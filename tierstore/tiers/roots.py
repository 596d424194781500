"""Where a store's tiers are on this machine, and the rule that keeps an operator's path out
of them: a command that writes, replaces or deletes a directory it is given never takes a
tier root, a folder inside one, or a folder above one (docs/design.md, "commands never
delete a tier root").

Paths are compared as the filesystem sees them: ``~``, ``..`` and symbolic links resolved
(:func:`os.path.realpath`), and, where both exist, by device and inode, so a second path to
the same directory (a bind mount, a link higher up) is the same directory. A tier that is
not a local directory (an object store, ``memory://``) has no root here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from tierstore._redact import redact_url
from tierstore.errors import ConfigError
from tierstore.format import layout
from tierstore.storage.registry import split_scheme
from tierstore.tiers.tier import Tier

__all__ = ["Overlap", "local_path", "local_root", "relation", "overlap", "refuse_overlap", "tier_below"]

_LOCAL_FSSPEC = ("fsspec+file", "fsspec+local")


@dataclass(frozen=True)
class Overlap:
    """``path`` is the root of ``tier`` (``how`` "is"), inside it ("inside") or above it
    ("above"); ``root`` is the tier's directory, resolved."""

    path: str
    tier: Tier
    root: str
    how: str

    def __str__(self) -> str:
        where = {"is": "is the root of", "inside": "is inside", "above": "is above"}[self.how]
        return f"{self.path} {where} the {self.tier.role} tier {redact_url(self.tier.url)} ({self.root})"


def local_root(tier: Tier) -> str | None:
    """The directory ``tier`` keeps its objects in, resolved; ``None`` if it is not local."""
    return local_path(tier.url)


def local_path(url: str | os.PathLike[str]) -> str | None:
    """The local directory a tier URL or path names, resolved; ``None`` for any other URL."""
    scheme, url = split_scheme(url)
    if scheme in _LOCAL_FSSPEC:
        url = url.split("+", 1)[1]
        scheme = "file"
    if scheme != "file":
        return None
    if "://" in url:
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            return None
        url = unquote(parsed.path)
    return _resolved(url)


def relation(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> str | None:
    """``"is"`` if ``path`` is ``directory``, ``"inside"`` or ``"above"`` it, else ``None``."""
    a, b = _resolved(os.fspath(path)), _resolved(os.fspath(directory))
    if _same(a, b):
        return "is"
    if any(_same(up, b) for up in _above(a)):
        return "inside"
    if any(_same(up, a) for up in _above(b)):
        return "above"
    return None


def overlap(path: str | os.PathLike[str], tiers: Iterable[Tier | None]) -> Overlap | None:
    """The first of ``tiers`` whose root ``path`` is, is inside or is above; ``None`` if none."""
    for tier in tiers:
        root = None if tier is None else local_root(tier)
        if tier is None or root is None:
            continue
        how = relation(path, root)
        if how is not None:
            return Overlap(_resolved(os.fspath(path)), tier, root, how)
    return None


def refuse_overlap(path: str | os.PathLike[str], tiers: Iterable[Tier | None], *, what: str) -> None:
    """Raise :class:`~tierstore.errors.ConfigError` if ``path`` is a root of ``tiers``, inside
    one or above one; ``what`` names the path in the message (``"--out"``)."""
    found = overlap(path, tiers)
    if found is not None:
        raise ConfigError(
            f"{what} {found}: a command never writes into, replaces or deletes a tier's "
            "directory or one that holds it; give a directory outside every tier",
            tier=found.tier.label,
        )


def tier_below(path: str | os.PathLike[str]) -> str | None:
    """The first directory at or below ``path`` that holds a tier (its ``manifests/`` with a
    manifest in it and its ``checkpoints/``, or a store identity object), links not
    followed; ``None`` if there is none. Walks what a recursive delete of ``path`` walks."""
    for directory, subdirs, files in os.walk(os.fspath(path)):
        if layout.STORE_ID_KEY in files or _holds_manifests(directory, subdirs):
            return directory
    return None


def _holds_manifests(directory: str, subdirs: list[str]) -> bool:
    if layout.MANIFEST_DIR not in subdirs or layout.DATA_DIR not in subdirs:
        return False
    try:
        names = os.listdir(os.path.join(directory, layout.MANIFEST_DIR))
    except OSError:
        return False
    return any(name.endswith(layout.MANIFEST_SUFFIX) for name in names)


def _resolved(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _above(path: str) -> list[str]:
    """Every directory strictly above ``path``, nearest first."""
    found = []
    while (parent := os.path.dirname(path)) != path:
        found.append(parent)
        path = parent
    return found


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): the resolved paths decided
        return False
