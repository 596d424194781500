"""Whether an object a backend answered 404 for is really gone.

One 404 is no proof: eventually consistent S3-compatibles and misrouting proxies answer one
for an object that is there, and a resume that took it for damage would quarantine a good
checkpoint and roll the job back a step (issue 34). An object counts as missing only when a
second request answers 404 as well and the listing of its folder does not show it.
"""

from __future__ import annotations

from tierstore.errors import ObjectNotFound
from tierstore.storage.backend import Backend

__all__ = ["proven_missing"]


def proven_missing(backend: Backend, key: str) -> bool:
    """``True`` when ``key`` is gone for sure: a ``stat`` now answers 404 and the listing of
    its folder does not name it. ``False`` when either finds it. Other storage errors
    propagate: a tier that cannot answer proves nothing."""
    try:
        backend.stat(key)
    except ObjectNotFound:
        pass
    else:
        return False
    folder = key.rpartition("/")[0]
    return not any(info.key == key for info in backend.list(folder + "/" if folder else ""))
