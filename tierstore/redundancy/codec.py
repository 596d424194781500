"""Erasure codes for :class:`~tierstore.redundancy.schemes.Parity`: XOR for one parity block,
Reed-Solomon through ``zfec`` (the ``erasure`` extra) for more.

XOR needs nothing beyond torch. Blocks are equal-length byte strings; block ``i < k`` is
data chunk ``i``, block ``k + j`` parity block ``j`` (systematic: data blocks stay as they are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierstore.errors import ConfigError

__all__ = ["decode", "encode", "require_zfec"]


def require_zfec(scheme: Any) -> Any:
    try:
        import zfec
    except ImportError:
        raise ConfigError(
            f"{scheme.describe()} with more than one parity block needs zfec: "
            "pip install 'tierstore[erasure]' (Parity(k, 1) is XOR and needs nothing)"
        ) from None
    return zfec


def _xor(blocks: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """The XOR of equal-length blocks, in place in a copy of the first (torch's vectorized
    kernel: three times Python's big integers)."""
    out = bytearray(blocks[0])
    if not out:
        return b""
    acc = torch.frombuffer(out, dtype=torch.uint8)
    for block in blocks[1:]:
        acc.bitwise_xor_(torch.frombuffer(bytearray(block), dtype=torch.uint8))
    return bytes(out)


def encode(data: Sequence[bytes], k: int, m: int) -> list[bytes]:
    """The ``m`` parity blocks of ``k`` data blocks."""
    if len(data) != k:
        raise ValueError(f"{len(data)} data blocks for k={k}")
    if m == 1:
        return [_xor(data)]
    zfec = require_zfec(_Named(k, m))
    return list(zfec.Encoder(k, k + m).encode([bytes(b) for b in data], list(range(k, k + m))))


def decode(blocks: Mapping[int, bytes], k: int, m: int) -> list[bytes]:
    """The ``k`` data blocks, from any ``k`` of the ``k + m`` blocks (by index)."""
    have = sorted(blocks)[:k]
    if len(have) < k:
        raise ValueError(f"{len(have)} blocks of {k + m}, {k} needed")
    if all(i < k for i in have):
        return [bytes(blocks[i]) for i in range(k)]
    if m == 1:
        missing = next(i for i in range(k) if i not in blocks)
        rebuilt = _xor([blocks[i] for i in have])
        return [rebuilt if i == missing else bytes(blocks[i]) for i in range(k)]
    zfec = require_zfec(_Named(k, m))
    return list(zfec.Decoder(k, k + m).decode([bytes(blocks[i]) for i in have], have))


class _Named:
    def __init__(self, k: int, m: int) -> None:
        self.k, self.m = k, m

    def describe(self) -> str:
        return f"Parity(k={self.k}, m={self.m})"
