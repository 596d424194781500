"""The scale simulator (issue 15): W simulated ranks in one process, every request counted.

``python -m benchmarks.scale`` (``make bench-scale``) replays DCP's save and load steps and
tierstore's migration, listing, prune and gc for W = 8 ... 16,384 ranks against a local
directory and the moto S3 server, and writes docs/scale.md. Modules: ``counting`` (the
counting backend), ``workload`` (what ranks save), ``sim`` (the replay), ``results`` and
``targets`` (what is reported and judged), ``report``, ``plot``, ``features``, ``cli``.
"""
