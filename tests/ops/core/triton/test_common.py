"""The host-side integer helpers that stand in for Triton's ``constexpr_function``s."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from liger_patch.ops.core.triton.common import ceil_div, pow2_at_least  # noqa: E402

_VALUES = [*range(-9, 70), 127, 128, 129, 4095, 4096, 4097, 151936, 262144, 262145, 2**40 + 3]


@pytest.mark.parametrize("b", [1, 2, 3, 16, 64, 128, 256, 4096])
def test_ceil_div_is_tritons(b):
    for a in _VALUES:
        assert ceil_div(a, b) == triton.cdiv(a, b), (a, b)


def test_pow2_at_least_is_tritons():
    for n in _VALUES:
        assert pow2_at_least(n) == triton.next_power_of_2(n), n
