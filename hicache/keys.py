"""Chained page hashes and the L3 key format (DESIGN §2).

A page's hash is SHA-256 (truncated to 16 bytes) over the previous page's hash and this
page's token bytes, seeded at the root of the chain by (namespace, model id, KV dtype, KV
geometry: `ModelConfig.geometry`). Two
daemons that computed the same prefix therefore derive the same keys, and any change
earlier in the prefix changes every later key. SHA-256 is used, not a faster
non-cryptographic hash, because a crafted collision would serve one request another's KV:
with SHA-NI it costs ~0.85 us a page here, and the tree computes it once per page, lazily.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from hicache.types import PageHash

PAGE_HASH_BYTES = 16
# 2: the seed binds the KV geometry (version 1's keys did not: two daemons with one model id
# and another geometry of equal page size shared, and misread, each other's objects).
LAYOUT_VERSION = 2
_SEED_TAG = b"hicache-chain-v2\0"


def chain_seed(namespace: str, model_id: str, kv_dtype: str, geometry: str) -> PageHash:
    """The hash that precedes the first page of every sequence in this namespace.
    `geometry`: the layers and bytes of every pool (`ModelConfig.geometry`): an L3 object's
    header checks its key and payload size only, and two layouts of equal size would
    otherwise share keys (a page read back in the other layout is wrong KV, not a miss)."""
    h = hashlib.sha256(_SEED_TAG)
    for part in (namespace, model_id, kv_dtype, geometry):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return PageHash(h.digest()[:PAGE_HASH_BYTES])


def chain_hashes(prev: bytes, token_bytes: bytes | memoryview, page_bytes: int) -> bytes:
    """Hashes of consecutive whole pages of `token_bytes` (little-endian uint32 ids),
    continuing the chain after `prev`; returned concatenated, PAGE_HASH_BYTES each.

    SHA-256, not a faster non-cryptographic hash: pages of one namespace are shared by its
    users, and a crafted collision would hand one user another's KV. One hash call per
    page on `prev + page` (a method call per update cost as much as the hashing)."""
    n = len(token_bytes) // page_bytes
    mv = memoryview(token_bytes)
    sha = hashlib.sha256
    size = PAGE_HASH_BYTES
    out = []
    for lo in range(0, n * page_bytes, page_bytes):
        prev = sha(prev + mv[lo : lo + page_bytes]).digest()[:size]
        out.append(prev)
    return b"".join(out)


def split_hashes(hashes: bytes) -> list[PageHash]:
    return [
        PageHash(hashes[i : i + PAGE_HASH_BYTES]) for i in range(0, len(hashes), PAGE_HASH_BYTES)
    ]


def namespace_tag(namespace: str) -> str:
    """A short, stable, non-identifying tag of a namespace (tenants are not named in L3)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:8]


# Keys the backends' own checks use (the deep health canary, capability probes), under
# the prefix every page key has (`hc<version>/`): an account limited to it can run them.
CANARY_PREFIX = f"hc{LAYOUT_VERSION}/canary/"


@functools.lru_cache(maxsize=1024)
def key_prefix(namespace: str, model_id: str) -> str:
    """The part of every L3 key that depends on the namespace and model only (cached: a
    request's keys differ only in their page hash and member)."""
    # ASCII only (every backend takes ASCII keys); the model id also seeds every page
    # hash, so two ids that read alike here still never share a page.
    model = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in model_id)[:48]
    return f"hc{LAYOUT_VERSION}/{namespace_tag(namespace)}/{model}/"


def storage_keys(
    namespace: str,
    model_id: str,
    page_hashes: Sequence[bytes],
    members: Sequence[str],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[str]:
    """The L3 object keys of these pages, page-major (page 0's members, then page 1's...).

    A key is `hc2/<ns-tag>/<model>/<hash hex>/<member>/tp<rank>of<size>`. The hash already
    binds the namespace, model id, KV dtype and geometry (they seed the chain); the readable prefix
    lets an operator see and delete one model's objects.
    """
    prefix = key_prefix(namespace, model_id)
    tails = [key_tail(m, tp_rank, tp_size) for m in members]
    return [f"{prefix}{h.hex()}{tail}" for h in page_hashes for tail in tails]


def key_tail(member: str, tp_rank: int = 0, tp_size: int = 1) -> str:
    """How the key of every object of `member` (for this rank) ends (see `storage_keys`)."""
    return f"/{member}/tp{tp_rank}of{tp_size}"


def storage_key(
    namespace: str,
    model_id: str,
    page_hash: bytes,
    member: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """The L3 object key of one page of one family member (see `storage_keys`)."""
    return storage_keys(namespace, model_id, (page_hash,), (member,), tp_rank, tp_size)[0]
