"""Header codec: every field is checked, and checking mutates nothing."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import ObjectCorrupt
from hicache.tiers.storage.integrity import HEADER_BYTES, MAGIC, check_object, write_header


def _object(payload: int = 256) -> np.ndarray:
    obj = np.zeros(HEADER_BYTES + payload, dtype=np.uint8)
    obj[HEADER_BYTES:] = np.arange(payload) % 251
    write_header(obj, "ns/a:full")
    return obj


def test_a_fresh_object_verifies_and_the_payload_is_untouched() -> None:
    obj = _object()
    assert bytes(obj[:4]) == MAGIC
    before = obj.copy()
    check_object(obj, "ns/a:full", obj.nbytes)
    np.testing.assert_array_equal(obj, before)


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        (0, "magic"),
        (4, "version"),
        (8, "payload bytes"),
        (16, "checksum"),
        (24, "another key"),
        (HEADER_BYTES + 7, "checksum"),
    ],
)
def test_any_flipped_field_is_caught(offset: int, message: str) -> None:
    obj = _object()
    obj[offset] ^= 0x01
    with pytest.raises(ObjectCorrupt, match=message):
        check_object(obj, "ns/a:full", obj.nbytes)


def test_wrong_key_and_short_object_are_caught() -> None:
    obj = _object()
    with pytest.raises(ObjectCorrupt, match="another key"):
        check_object(obj, "ns/b:full", obj.nbytes)
    with pytest.raises(ObjectCorrupt, match="bytes, expected"):
        check_object(obj, "ns/a:full", obj.nbytes - 1)
