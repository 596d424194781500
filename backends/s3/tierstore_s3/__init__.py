"""tierstore's S3 tier: ``s3://bucket[/prefix]`` URLs, registered through the
``tierstore.backends`` entry point (see :class:`S3Backend`)."""

from __future__ import annotations

from tierstore_s3._backend import S3Backend

__all__ = ["S3Backend"]
