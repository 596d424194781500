"""The commit protocol: where files live, the manifest that commits them, DCP's writer and reader.

- :mod:`~tierstore.commit.layout`: every key in a tier (the one place that builds paths).
- :mod:`~tierstore.commit.manifest`: the manifest, the commit record of one checkpoint.
- :mod:`~tierstore.commit.writer` / :mod:`~tierstore.commit.reader`: ``TieredWriter`` and
  ``TieredReader``, DCP's ``StorageWriter`` / ``StorageReader``.
- :mod:`~tierstore.commit.safe_pickle`: the allow-listed unpickler for DCP metadata.
"""
