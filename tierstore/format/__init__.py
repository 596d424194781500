"""The store's format: where every object lives and what vouches for it, with no I/O above a
single verified read.

- :mod:`~tierstore.format.layout`: every key in a tier (the one place that builds paths).
- :mod:`~tierstore.format.manifest`, :mod:`~tierstore.format.manifest_format`: the manifest,
  the commit record of one checkpoint, and its JSON forms.
- :mod:`~tierstore.format.encoding`: the raw encoding of data files (``RawItem``).
- :mod:`~tierstore.format.safe_pickle`: the allow-listed unpickler for DCP metadata.
- :mod:`~tierstore.format.verified`: the one verified read of a stored file.
"""
