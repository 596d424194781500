"""What the benchmark jobs run on: ``launch`` (processes, on the tests' launcher),
``servers`` and ``latency_proxy`` (each in its own process), ``measure`` (inside a job),
``stats`` (over repeated measurements) and ``machine`` (what the run ran on). Standard
library only at import time."""
