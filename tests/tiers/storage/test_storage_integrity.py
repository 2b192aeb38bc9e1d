"""Header codec: every field is checked, and checking mutates nothing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from hicache.errors import ObjectCorrupt
from hicache.tiers.storage.integrity import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    check_object,
    key_digest,
    verified_objects,
    write_header,
    write_headers,
)


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


def _batch(payloads: list[int]) -> tuple[list[np.ndarray], list[str]]:
    """Objects of the given payload sizes with distinct payloads and keys, headers still 0xAA."""
    rng = np.random.default_rng(7)
    objs = [np.full(HEADER_BYTES + n, 0xAA, dtype=np.uint8) for n in payloads]
    for obj in objs:
        obj[HEADER_BYTES:] = rng.integers(0, 256, obj.nbytes - HEADER_BYTES, dtype=np.uint8)
    return objs, [f"ns/{i}:full" for i in range(len(objs))]


def test_batch_headers_are_the_documented_layout() -> None:
    """Built independently here: magic, version, reserved, payload length, checksum and
    key digest, little-endian, zero padding to 64 bytes; the payload is untouched."""
    objs, keys = _batch([256, 4096, 256, 1000])
    payloads = [obj[HEADER_BYTES:].copy() for obj in objs]
    write_headers(objs, keys)
    for obj, payload, key in zip(objs, payloads, keys, strict=True):
        want = struct.pack("<4sHHQQ16s", MAGIC, FORMAT_VERSION, 0, payload.size,
                           xxhash.xxh3_64_intdigest(payload.tobytes()), key_digest(key))
        assert bytes(obj[:HEADER_BYTES]) == want + bytes(HEADER_BYTES - len(want))
        np.testing.assert_array_equal(obj[HEADER_BYTES:], payload)


def test_batch_verification_agrees_with_check_object_on_every_corruption() -> None:
    objs, keys = _batch([256] * 9 + [512])
    write_headers(objs, keys)
    sizes = [obj.nbytes for obj in objs]
    assert verified_objects(objs, keys, sizes) == [True] * 10
    objs[1][0] ^= 1  # magic
    objs[2][4] ^= 1  # version
    objs[3][6] ^= 1  # reserved
    objs[4][8] ^= 1  # payload length
    objs[5][16] ^= 1  # checksum field
    objs[6][30] ^= 1  # key digest
    objs[7][HEADER_BYTES + 200] ^= 1  # payload
    keys[8] = "ns/other:full"  # stored under another key
    sizes[9] -= 1  # the store held a shorter object
    before = [obj.copy() for obj in objs]
    ok = verified_objects(objs, keys, sizes)
    assert ok == [True] + [False] * 9
    for obj, copy in zip(objs, before, strict=True):
        np.testing.assert_array_equal(obj, copy)  # verifying mutates nothing
    for obj, key, size, good in zip(objs, keys, sizes, ok, strict=True):
        if good:
            check_object(obj, key, size)
        else:
            with pytest.raises(ObjectCorrupt):
                check_object(obj, key, size)


def test_batch_verification_of_nothing_is_empty() -> None:
    assert verified_objects([], [], []) == []
    write_headers([], [])
