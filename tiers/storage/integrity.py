"""Object header codec: every L3 object is `HEADER_BYTES` of header followed by the payload.

Layout (little endian, 64 bytes, the rest zero):

    offset  size  field
    0       4     magic  b"HKV\\x01"
    4       2     format version (FORMAT_VERSION)
    6       2     reserved (0)
    8       8     payload length in bytes
    16      8     xxh3_64 checksum of the payload
    24      16    key digest: blake2b(key, digest_size=16)

The checksum is xxh3_64: measured here on 64 KiB pages, xxh3_64 12.9 GB/s, crc32c 12.0 GB/s,
zlib.crc32 3.3 GB/s (2-core VM, one run). Both fast ones cost ~5 µs per 64 KiB page, small next to
any L3 transfer; xxh3 also gives 64 bits instead of 32.

The key digest binds an object to its key, so a value stored under the wrong key (a bug, or a
colliding file name) is caught even when its checksum is intact.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import xxhash

from hicache.errors import ObjectCorrupt

HEADER_BYTES = 64
FORMAT_VERSION = 1
MAGIC = b"HKV\x01"

_HEADER = struct.Struct("<4sHHQQ16s")
_PAD = bytes(HEADER_BYTES - _HEADER.size)


def key_digest(key: str) -> bytes:
    """16-byte digest of a key (also names files in the file backend)."""
    return hashlib.blake2b(key.encode("ascii"), digest_size=16).digest()


def payload_checksum(payload: np.ndarray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload if isinstance(payload, memoryview) else payload.data)


def write_header(obj: np.ndarray, key: str) -> None:
    """Fill `obj[:HEADER_BYTES]` in place for the payload `obj[HEADER_BYTES:]` stored under `key`.

    Mutates only the header area; the payload is read, never changed.
    """
    view = obj.data
    length = len(view) - HEADER_BYTES
    checksum = xxhash.xxh3_64_intdigest(view[HEADER_BYTES:])
    _HEADER.pack_into(view, 0, MAGIC, FORMAT_VERSION, 0, length, checksum, key_digest(key))
    view[_HEADER.size : HEADER_BYTES] = _PAD


def check_object(obj: np.ndarray, key: str, stored_bytes: int) -> None:
    """Verify an object read into `obj` (of which `stored_bytes` came from the store).

    Raises `ObjectCorrupt` naming the first mismatch: object size, magic, version, payload
    length, key digest or checksum. Mutates nothing.
    """
    view = obj.data
    if stored_bytes != len(view):
        raise ObjectCorrupt(f"{key}: stored object has {stored_bytes} bytes, expected {len(view)}")
    magic, version, _, length, checksum, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ObjectCorrupt(f"{key}: bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ObjectCorrupt(f"{key}: format version {version}, expected {FORMAT_VERSION}")
    if length != len(view) - HEADER_BYTES:
        raise ObjectCorrupt(
            f"{key}: header says {length} payload bytes, expected {len(view) - HEADER_BYTES}"
        )
    if digest != key_digest(key):
        raise ObjectCorrupt(f"{key}: object belongs to another key")
    if xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != checksum:
        raise ObjectCorrupt(f"{key}: payload checksum mismatch")
