"""Drop-ins for the trainers that decide where checkpoints go (see docs/integrations.md).

Each integration is a module of its own that imports its framework, installed with an extra
(``pip install "tierstore[lightning]"``): importing this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
