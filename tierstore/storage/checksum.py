"""CRC32C, the one checksum of stored bytes: extend it over a buffer, or combine two.

:func:`crc32c_combine` gives the CRC32C of ``a + b`` from the CRC32Cs of ``a`` and ``b`` and
the length of ``b``, without the bytes. The raw encoding checksums each block of a tensor once
as it writes it and folds the block checksums into the file's (docs/format.md), so no byte
is scanned twice. The combine works in GF(2): shifting a CRC by ``n`` zero bytes is a
multiplication by ``x^(8n)`` modulo the CRC polynomial, computed by squaring, so it costs
O(log n) 32-bit multiplications whatever ``n`` is: about 30 us in Python for a power of two
(a raw block), up to ten times that for a length with many bits set. Scanning a buffer
again costs less below about 1 MiB; callers pick (``COMBINE_MIN``).
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["COMBINE_MIN", "crc32c_combine", "crc32c_update"]

#: Below this many bytes, re-scanning a buffer is cheaper than combining its CRC32C.
COMBINE_MIN = 1 << 20

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_ONE = 1 << 31  # the polynomial 1 in reflected order


def crc32c_update(crc: int, data: Any) -> int:
    """Extend a CRC32C with any buffer (bytes, memoryview, numpy/tensor memory), copy-free."""
    return int(_crc32c.crc32c(data, crc))


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial; ``a`` must not be 0 (no power of x is)."""
    product, bit = 0, _ONE
    while True:
        if a & bit:
            product ^= b
            if not a & (bit - 1):
                return product
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial for k = 0..63, each the square of the one before."""
    table = [_ONE >> 1]  # x^1
    for _ in range(63):
        table.append(_multiply(table[-1], table[-1]))
    return tuple(table)


_X_2K = _powers()  # a constant of the polynomial, computed once at import


def _x_to_the_8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: the operator that shifts a CRC by ``n`` zero bytes."""
    result, k = _ONE, 3  # x^0; bit 0 of n stands for x^8 = x^(2^3)
    while n:
        if n & 1:
            result = _multiply(_X_2K[k], result)
        n >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``a + b`` given ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    if not 0 <= len_b < 1 << 60:
        raise ValueError(f"length must be in [0, 2**60), got {len_b}")
    return _multiply(_x_to_the_8n(len_b), crc_a) ^ crc_b
