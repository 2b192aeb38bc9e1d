"""Component hooks on their own, against their definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hicache.tree.components.swa import SwaComponent


@given(st.lists(st.integers(-1, 5), max_size=200))
def test_swa_split_breaks_are_where_present_and_absent_ids_alternate(ids: list[int]) -> None:
    # A node is cut wherever the given SWA ids switch between a page id and -1 (a page
    # freed outside the window), so every resulting node is all present or all absent.
    want = [i for i in range(1, len(ids)) if (ids[i] < 0) != (ids[i - 1] < 0)]
    swa = SwaComponent(1, 64, 4096)
    assert swa.split_breaks(np.array(ids, dtype=np.int64)) == want
