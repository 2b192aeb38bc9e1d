"""Mutation review, fourth round (tiers): the CPU copy engine's checks that no other test
pinned; each test names the mutant of `hicache.tiers.copy` it kills and passes on the
product as it is. Real shm L1 pools (`make_device`) and real L2 pools (`make_host`)."""

from __future__ import annotations

import numpy as np
import pytest
from tierkit import tiny_config

from hicache.errors import InvalidArgument
from hicache.tiers.copy import CpuCopyEngine
from hicache.types import ComponentKind

FULL = ComponentKind.FULL


def test_a_load_into_an_l1_page_past_l1_but_inside_l2_is_refused_before_any_byte_moves(
    make_device, make_host
) -> None:
    """The tiny model has 16 L1 FULL pages and 32 L2 pages. A load (`host_to_device`) of
    L2 page 3 into L1 page 16 names a slot past the end of L1 that L2 would still hold:
    it is InvalidArgument naming the L1 ids and L1's range [0, 16), raised before any
    byte moves (L1 page 15 and L2 page 3 keep their bytes); the same load into L1 page
    15 goes through and copies the page's bytes of every layer of every family member.
    Mutant killed: `host_to_device` checking its L1 ids against the L2 pools'
    (`validate_copy(family, host, host_ids, host, device_ids, ...)`): page 16 then
    passes the check and numpy raises IndexError from inside the copy."""
    cfg = tiny_config()
    dev, host = make_device(cfg), make_host(cfg)
    engine = CpuCopyEngine(dev, host)
    layers = {m.name: m.layers for m in host.family(FULL)}
    assert layers == {"full": 2, "idx": 3}
    for name, n in layers.items():
        for layer in range(n):
            host.layer_array(name, layer)[3] = 10 + layer
            dev.layer_array(name, layer)[15] = 0
    with pytest.raises(InvalidArgument, match=r"full L1 ids \[16\] out of range \[0, 16\)"):
        engine.host_to_device(FULL, np.array([3], np.int64), np.array([16], np.int64))
    assert int(dev.layer_array("full", 0)[15].max()) == 0
    result = engine.host_to_device(FULL, np.array([3], np.int64), np.array([15], np.int64))
    assert (result.pages, result.layers) == (1, 3)
    for name, n in layers.items():
        for layer in range(n):
            assert bool((dev.layer_array(name, layer)[15] == 10 + layer).all()), (name, layer)
    engine.close()
