"""Mutation review (session 31) of the L3 key format: what seeds a page hash chain."""

from __future__ import annotations

import numpy as np

from hicache.keys import chain_hashes, chain_seed, split_hashes, storage_keys


def _first_page_key(namespace: str, model_id: str, kv_dtype: str, geometry: str) -> str:
    tokens = np.arange(16, dtype="<u4").tobytes()
    (page,) = split_hashes(chain_hashes(chain_seed(namespace, model_id, kv_dtype, geometry), tokens, 64))
    (key,) = storage_keys(namespace, model_id, [page], ["full"])
    return key


def test_the_kv_dtype_seeds_the_chain_so_other_precisions_never_share_objects() -> None:
    """Two daemons serving one model id in another KV dtype (bf16 vs fp8) store other
    bytes for the same prefix: their page hashes, and so their L3 keys, differ (a page
    read back in the other dtype would be wrong KV, not a miss)."""
    # Mutant: chain_seed leaving kv_dtype out of the seed.
    assert chain_seed("ns", "m", "bfloat16", "g") != chain_seed("ns", "m", "float8_e4m3fn", "g")
    assert _first_page_key("ns", "m", "bfloat16", "g") != _first_page_key("ns", "m", "float8_e4m3fn", "g")
    assert _first_page_key("ns", "m", "bfloat16", "g") == _first_page_key("ns", "m", "bfloat16", "g")


def test_seed_fields_are_delimited_so_shifted_boundaries_never_collide() -> None:
    """Namespace, model id, dtype and geometry are each bound with their length: moving
    characters from one field to the next (tenant "ab" + model "c" vs tenant "a" + model
    "bc") seeds another chain, so one tenant can never pick a namespace that reads
    another's objects."""
    # Mutant: chain_seed without the length prefix of each field.
    assert chain_seed("ab", "c", "bf16", "g") != chain_seed("a", "bc", "bf16", "g")
    assert chain_seed("ns", "m", "bf16", "") != chain_seed("ns", "m", "", "bf16")
    assert chain_seed("ns", "m1", "6", "g") != chain_seed("ns", "m", "16", "g")
