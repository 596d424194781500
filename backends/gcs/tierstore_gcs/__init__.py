"""Google Cloud Storage tier for tierstore: ``gs://bucket[/prefix]`` (also ``gcs://``).

Installed, it registers itself through the ``tierstore.backends`` entry-point group::

    TieredWriter(hot="/nvme/run1", cold="gs://bucket/run1", step=1200)
"""

from __future__ import annotations

from tierstore_gcs._backend import DEFAULT_PART_SIZE, GCSBackend

__all__ = ["GCSBackend", "DEFAULT_PART_SIZE"]
