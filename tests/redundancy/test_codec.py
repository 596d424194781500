"""The erasure codes behind ``Parity(k, m)`` (issue 37): XOR for one parity block, zfec's
Reed-Solomon for more. Any ``m`` lost blocks of ``k + m``, data or parity, rebuild the data
byte-exact; fewer than ``k`` blocks is an error, never wrong bytes."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import ConfigError
from tierstore.redundancy import Parity, codec


@st.composite
def stripes(draw: st.DrawFn) -> tuple[int, int, list[bytes], list[int]]:
    """``(k, m, data blocks, lost indices)``: equal-length blocks (0 and odd lengths
    included) and any ``m`` or fewer of the ``k + m`` blocks lost."""
    k = draw(st.integers(1, 6))
    m = draw(st.integers(1, 3))
    size = draw(st.one_of(st.sampled_from([0, 1, 7, 255, 4097]), st.integers(0, 300)))
    data = [draw(st.binary(min_size=size, max_size=size)) for _ in range(k)]
    lost = draw(st.lists(st.integers(0, k + m - 1), max_size=m, unique=True))
    return k, m, data, lost


@settings(max_examples=300, deadline=None)
@given(stripes())
def test_any_m_lost_blocks_rebuild_the_data_byte_exact(
    stripe: tuple[int, int, list[bytes], list[int]],
) -> None:
    k, m, data, lost = stripe
    parity = codec.encode(data, k, m)
    assert len(parity) == m and all(len(p) == len(data[0]) for p in parity)
    blocks = dict(enumerate(data + parity))
    for index in lost:
        del blocks[index]
    assert codec.decode(blocks, k, m) == data


@settings(max_examples=100, deadline=None)
@given(stripes())
def test_exactly_m_lost_data_blocks_rebuild_from_parity(
    stripe: tuple[int, int, list[bytes], list[int]],
) -> None:
    # The hardest case: as many data blocks lost as there are parity blocks (or all k).
    k, m, data, _ = stripe
    parity = codec.encode(data, k, m)
    lost = set(range(min(k, m)))
    blocks = {i: b for i, b in enumerate(data + parity) if i not in lost}
    assert codec.decode(blocks, k, m) == data


@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_parity_is_not_a_copy_of_the_data(m: int) -> None:
    # Guards against an encoder that returns something that happens to round-trip only
    # when nothing is lost: a lost data block must come back from the parity alone.
    data = [bytes([i + 1]) * 9 + bytes(range(i, i + 4)) for i in range(3)]
    parity = codec.encode(data, 3, m)
    assert codec.decode({1: data[1], 2: data[2], 3: parity[0]}, 3, m)[0] == data[0]
    assert codec.decode({0: data[0], 2: data[2], 3: parity[0]}, 3, m)[1] == data[1]


def test_xor_parity_is_the_xor_of_the_data() -> None:
    assert codec.encode([b"\x0f\xf0", b"\xff\x00", b"\x01\x01"], 3, 1) == [b"\xf1\xf1"]
    assert codec.encode([b"", b""], 2, 1) == [b""]


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 1), (3, 1), (2, 2), (4, 3)])
def test_fewer_than_k_blocks_is_a_value_error(k: int, m: int) -> None:
    data = [bytes([i]) * 5 for i in range(k)]
    blocks = dict(enumerate(data + codec.encode(data, k, m)))
    for index in list(blocks)[: m + 1]:  # one more than the code survives
        del blocks[index]
    with pytest.raises(ValueError, match=f"{k - 1} blocks of {k + m}, {k} needed"):
        codec.decode(blocks, k, m)
    with pytest.raises(ValueError, match=f"0 blocks of {k + m}"):
        codec.decode({}, k, m)


def test_encode_refuses_a_data_count_other_than_k() -> None:
    with pytest.raises(ValueError, match="2 data blocks for k=3"):
        codec.encode([b"a", b"b"], 3, 1)
    with pytest.raises(ValueError, match="4 data blocks for k=3"):
        codec.encode([b"a"] * 4, 3, 2)


def test_without_zfec_parity_of_more_than_one_block_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zfec", None)  # import zfec now raises ImportError
    with pytest.raises(ConfigError, match=r"tierstore\[erasure\]") as info:
        Parity(3, 2)
    assert "Parity(k=3, m=2)" in str(info.value)
    with pytest.raises(ConfigError, match=r"tierstore\[erasure\]"):
        codec.encode([b"ab", b"cd"], 2, 2)
    with pytest.raises(ConfigError, match=r"tierstore\[erasure\]"):
        codec.decode({1: b"cd", 2: b"xx"}, 2, 2)
    # XOR needs nothing: Parity(k, 1) builds, encodes and rebuilds without zfec.
    assert Parity(3, 1).m == 1
    data = [b"ab", b"cd", b"ef"]
    [parity] = codec.encode(data, 3, 1)
    assert codec.decode({0: data[0], 2: data[2], 3: parity}, 3, 1) == data
