"""The wrapper-free reductions agree with numpy's own on every input."""

from __future__ import annotations

import numpy as np
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hicache.arrays import all_of, any_negative, any_of, max_of, min_of, negative_mask

ids = st.lists(st.integers(-(2**40), 2**40), max_size=300).map(lambda xs: np.array(xs, dtype=np.int64))
masks = st.lists(st.booleans(), max_size=300).map(lambda xs: np.array(xs, dtype=np.bool_))


@fuzz_settings(100)
@given(ids)
def test_min_and_max_match_numpy(a: np.ndarray) -> None:
    if a.size:
        assert min_of(a) == int(a.min()) and max_of(a) == int(a.max())
        assert isinstance(min_of(a), int)


@fuzz_settings(100)
@given(masks)
def test_any_and_all_match_numpy(m: np.ndarray) -> None:
    assert any_of(m) is bool(m.any())
    assert all_of(m) is bool(m.all())


@fuzz_settings(100)
@given(ids)
def test_any_negative_and_negative_mask_match_numpy(a: np.ndarray) -> None:
    assert any_negative(a) is bool((a < 0).any())
    assert negative_mask(a) == (a < 0).astype(np.uint8).tobytes()


def test_sign_byte_reads_on_both_sides_of_the_byte_search() -> None:
    for n in (1, 512, 513, 5000):  # sign bytes up to 512 ids, a reduction past that
        a = np.arange(n, dtype=np.int64)
        assert not any_negative(a)
        assert negative_mask(a) == bytes(n)
        a[-1] = -1
        assert any_negative(a)
        a[-1] = -(2**40)
        assert any_negative(a)
        assert negative_mask(a) == bytes(n - 1) + b"\x01"
