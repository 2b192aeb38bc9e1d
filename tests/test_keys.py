"""L3 object keys and chained page hashes: the format other nodes depend on."""

from __future__ import annotations

import hashlib

import numpy as np

from hicache.keys import (
    PAGE_HASH_BYTES,
    chain_hashes,
    chain_seed,
    split_hashes,
    storage_key,
    storage_keys,
)


def test_key_format_is_stable() -> None:
    key = storage_key("tenant-a", "org/model:v1", bytes(range(16)), "full", 1, 4)
    tag = hashlib.sha256(b"tenant-a").hexdigest()[:8]
    assert key == f"hc2/{tag}/org_model_v1/000102030405060708090a0b0c0d0e0f/full/tp1of4"
    assert "tenant-a" not in key  # tenants are not named in L3


def test_batch_keys_are_page_major_and_equal_single_keys() -> None:
    hashes = [bytes([i]) * PAGE_HASH_BYTES for i in range(5)]
    members = ["full", "full.indexer"]
    keys = storage_keys("ns", "m", hashes, members, 0, 2)
    assert keys == [storage_key("ns", "m", h, m, 0, 2) for h in hashes for m in members]
    assert len(set(keys)) == len(keys)


def test_namespaces_and_models_never_share_keys() -> None:
    h = [b"\x07" * PAGE_HASH_BYTES]
    assert storage_keys("a", "m", h, ["full"]) != storage_keys("b", "m", h, ["full"])
    assert storage_keys("a", "m1", h, ["full"]) != storage_keys("a", "m2", h, ["full"])


def test_chain_hashes_bind_every_earlier_page() -> None:
    seed = chain_seed("ns", "model", "bfloat16", "g")
    tokens = np.arange(4 * 8, dtype="<u4").tobytes()
    base = split_hashes(chain_hashes(seed, tokens, 8 * 4))
    changed = bytearray(tokens)
    changed[0] ^= 1  # first token of page 0
    other = split_hashes(chain_hashes(seed, bytes(changed), 8 * 4))
    assert len(base) == 4 and all(a != b for a, b in zip(base, other, strict=True))
    assert split_hashes(chain_hashes(chain_seed("ns2", "model", "bfloat16", "g"), tokens, 32))[0] != base[0]


def test_chain_hash_format_is_sha256_of_previous_hash_and_page() -> None:
    """The L3 key format: changing it strands every object stored by other nodes."""
    prev = chain_seed("ns", "model", "bfloat16", "g")
    tokens = np.arange(3 * 64, dtype="<u4").tobytes()
    want = []
    for i in range(3):
        prev = hashlib.sha256(prev + tokens[i * 256 : (i + 1) * 256]).digest()[:16]
        want.append(prev)
    assert chain_hashes(chain_seed("ns", "model", "bfloat16", "g"), tokens, 256) == b"".join(want)
    # A partial last page is not hashed.
    assert chain_hashes(want[0], tokens[256:] + b"\x00" * 7, 256) == b"".join(want[1:])


def test_a_non_ascii_model_id_still_gives_ascii_keys_and_distinct_chains() -> None:
    """Every backend takes ASCII keys only (a Unicode model id made every L3 call fail);
    ids that read alike in the key still seed different page hashes."""
    seed = bytes(PAGE_HASH_BYTES)
    key = storage_key("", "модель-7b", seed, "full")
    assert key.isascii()
    assert chain_seed("", "модель-7b", "bf16", "g") != chain_seed("", "модуль-7b", "bf16", "g")


def test_the_geometry_seeds_the_chain() -> None:
    """Pools of equal page size but other layers, bytes, windows or members are another
    model's KV: they seed other chains (and so other L3 keys)."""
    from hicache.config import build_config

    def geometry(components: dict, sidecars: dict | None = None) -> str:
        raw = {"model": {"page_size": 64, "components": components, "sidecars": sidecars or {}}}
        return build_config(raw).model.geometry

    full = {"full": {"layers": 4, "bytes_per_token_per_layer": 256}}
    swa = {"layers": 4, "bytes_per_token_per_layer": 256, "window_tokens": 1024}
    variants = [
        geometry(full),
        geometry({"full": {"layers": 8, "bytes_per_token_per_layer": 128}}),  # same page bytes
        geometry({**full, "swa": swa}),
        geometry({**full, "swa": {**swa, "window_tokens": 2048}}),
        geometry(full, {"indexer": {"anchor": "full", "layers": 4, "bytes_per_token_per_layer": 16}}),
    ]
    assert len(set(variants)) == len(variants)
    seeds = {chain_seed("", "m", "bf16", g) for g in variants}
    assert len(seeds) == len(variants)
    assert geometry(full) == geometry(dict(full))  # a pure function of the configuration
