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
(its threads slept between calls): there one `min_of` of a single id took ~10 µs, and a
comparison that takes 0.6 µs timed alone took 2-4 µs. Where a request asks which or
whether int64 ids are negative (SWA's absent pages), `negative_mask` and `any_negative`
read each id's sign byte with bytes operations instead, up to a few hundred ids; past
that, copying 8 bytes an id costs more than the ufunc saves.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

_min = np.minimum.reduce
_max = np.maximum.reduce
_less = np.less
_SIGN_BYTE = 7 if sys.byteorder == "little" else 0  # of an int64
_NEGATIVE = bytes(int(b >= 0x80) for b in range(256))  # sign byte -> 1 if negative
SIGN_BYTES_MAX = 512  # ids read by their sign bytes; past this, one ufunc call


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
    """Whether an int64 array holds a negative id (False when empty): by the sign bytes
    (`isascii`: none has its top bit set) up to `SIGN_BYTES_MAX` ids, else `min_of`."""
    if len(ids) <= SIGN_BYTES_MAX:
        return not ids.tobytes()[_SIGN_BYTE::8].isascii()
    return min_of(ids) < 0


def negative_mask(ids: npt.NDArray[np.int64]) -> bytes:
    """One byte per id of an int64 array: 1 where it is negative, else 0 (by the sign bytes
    up to `SIGN_BYTES_MAX` ids, else one comparison)."""
    if len(ids) <= SIGN_BYTES_MAX:
        return ids.tobytes()[_SIGN_BYTE::8].translate(_NEGATIVE)
    return _less(ids, 0).tobytes()
