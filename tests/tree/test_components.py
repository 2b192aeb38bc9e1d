"""Component hooks on their own, against their definitions."""

from __future__ import annotations

import numpy as np
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hicache.tree.components.swa import SwaComponent


@fuzz_settings(100)
@given(st.lists(st.integers(-1, 5), max_size=200))
def test_swa_split_breaks_are_where_absent_ids_follow_present_ones(ids: list[int]) -> None:
    # A node may hold absent pages then present ones (an SWA slot keeps the tail an
    # engine did not free), so a node is cut only where a -1 follows a page id: every
    # resulting piece is some -1 then some page ids.
    want = [i for i in range(1, len(ids)) if ids[i] < 0 <= ids[i - 1]]
    swa = SwaComponent(1, 64, 4096)
    breaks = swa.split_breaks((np.array(ids, dtype=np.int64) < 0).tobytes())
    assert breaks == want
    for lo, hi in zip([0, *breaks], [*breaks, len(ids)], strict=True):
        piece = [i >= 0 for i in ids[lo:hi]]
        assert piece == sorted(piece)  # absent first, then present
