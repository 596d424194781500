"""Resumable upload sessions kept across processes, so a rerun goes on where a killed upload
stopped. S3 finds an interrupted upload by listing; GCS cannot list sessions, so each writer
records its own.

One small JSON file per object being uploaded, in a local directory (the tier's
``session_dir``, by default :data:`DEFAULT_SESSION_DIR`; gsutil keeps its tracker files so):
the session's URL, how many bytes GCS confirmed and their CRC32C. A file is written after each
chunk GCS confirmed and removed once the object is stored or the upload cancelled; one older
than :data:`SESSION_LIFETIME` is ignored (GCS ends a session a week after it began). A
session URL is a bearer capability for its one upload: the files are the user's alone (0600,
in a 0700 directory), and no log line or error shows one.

Nothing a file says is trusted. A write that finds one reuses its session only if the CRC32C
of its own first ``offset`` bytes is the one recorded, and the object the session stores is
verified whole against every byte written (size and CRC32C), as every upload is. A file that
cannot be read or written costs the resume, never the upload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["DEFAULT_SESSION_DIR", "SESSION_LIFETIME", "SessionFile", "Tracked"]

log = logging.getLogger(__name__)

DEFAULT_SESSION_DIR = "~/.cache/tierstore/gcs-sessions"
SESSION_LIFETIME = 6 * 24 * 3600.0  # seconds; GCS keeps a session for 7 days


@dataclass(frozen=True)
class Tracked:
    """What a writer recorded of its session: GCS confirmed ``offset`` bytes of CRC32C ``crc32c``."""

    session: str
    offset: int
    crc32c: int
    started: float  # time.time() when the session began


class SessionFile:
    """The record of one object's session: ``directory``/<digest of endpoint, bucket, name>.json."""

    def __init__(self, directory: str, endpoint: str, bucket: str, name: str) -> None:
        self.target = f"{endpoint.rstrip('/')}/{bucket}/{name}"
        digest = hashlib.sha256(self.target.encode()).hexdigest()[:32]
        self.path = Path(os.path.expanduser(directory)) / f"{digest}.json"

    def load(self, now: float | None = None) -> Tracked | None:
        """The recorded session, if there is one worth trying."""
        now = time.time() if now is None else now
        try:
            record = json.loads(self.path.read_text())
            tracked = Tracked(
                str(record["session"]), int(record["offset"]), int(record["crc32c"]), float(record["started"])
            )
            if record.get("target") != self.target:
                return None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.debug("ignoring an unreadable upload session record %s: %s", self.path, err)
            return None
        if now - tracked.started > SESSION_LIFETIME or tracked.offset <= 0:
            self.drop()
            return None
        return tracked

    def save(self, tracked: Tracked) -> None:
        record = json.dumps({"target": self.target, **asdict(tracked)})
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(record)
            os.replace(temporary, self.path)
        except OSError as err:
            log.debug("could not record an upload session in %s (no resume): %s", self.path.parent, err)

    def drop(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            log.debug("could not remove upload session record %s: %s", self.path, err)
