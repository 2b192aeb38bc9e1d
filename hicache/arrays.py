"""Reductions over page-id arrays for the request paths: without numpy's Python-level
wrappers, and without letting go of the GIL.

`ndarray.min()`, `.max()`, `.any()` and `.all()` run through `numpy._core._methods`
(~1.4 µs each here). `argmin` and `argmax` are C methods (~0.4 µs), but they release the
GIL on every call, however small the array: any thread waiting for it (the copy worker,
gRPC's poller, another request) takes it, and the request then waits until that thread
lets go. Beside one busy thread, an `argmin` of 16 ids took 140 µs here instead of 0.4.
The ufunc reductions called directly (`np.minimum.reduce`, ~0.9 µs) keep the GIL below a
few hundred elements, where the work is too small to share; a boolean mask is tested by
searching its bytes (~0.3 µs).

In the daemon a ufunc costs more than these warm figures: each request meets cold caches
(its threads slept between calls), and there one `min_of` of a single id took ~10 µs. Where
a request only asks whether some id is negative, `any_negative` reads sign bytes instead.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

_min = np.minimum.reduce
_max = np.maximum.reduce
_SIGN_BYTE = 7 if sys.byteorder == "little" else 0  # of an int64
_SIGN_SEARCH_MAX = 512  # past this many ids, one reduction costs less than the byte copies


def min_of(ids: npt.NDArray[np.integer]) -> int:
    """The smallest id of a non-empty array."""
    return int(_min(ids))


def max_of(ids: npt.NDArray[np.integer]) -> int:
    """The largest id of a non-empty array."""
    return int(_max(ids))


def any_of(mask: npt.NDArray[np.bool_]) -> bool:
    """`mask.any()` for a boolean array (False when empty)."""
    return b"\x01" in mask.tobytes()


def all_of(mask: npt.NDArray[np.bool_]) -> bool:
    """`mask.all()` for a boolean array (True when empty)."""
    return b"\x00" not in mask.tobytes()


def any_negative(ids: npt.NDArray[np.int64]) -> bool:
    """Whether an int64 array holds a negative id (False when empty): up to 512 ids by their
    sign bytes (`isascii`: no byte has its top bit set), without a ufunc; past that by
    `min_of`."""
    if len(ids) <= _SIGN_SEARCH_MAX:
        return not ids.tobytes()[_SIGN_BYTE::8].isascii()
    return min_of(ids) < 0
