"""The content oracle itself: it must fail a reply that lists fewer pages than the hit it
claims (missing pages were checked less, and the hit still counted), and a page whose
bytes moved within the row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.bench.oracle import KvOracle
from hicache.config import MemberSpec
from hicache.types import ComponentKind

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
PAGE, LAYERS, WIDTH, POOL = 4, 2, 256, 64


@pytest.fixture
def written() -> tuple[KvOracle, bytes, dict[str, np.ndarray]]:
    members = [MemberSpec("full", FULL, FULL, LAYERS, WIDTH, 0),
               MemberSpec("swa", SWA, SWA, LAYERS, WIDTH, 2 * PAGE),
               MemberSpec("mamba", MAMBA, MAMBA, LAYERS, WIDTH, 0)]
    pools = {m.name: tuple(torch.zeros(POOL, WIDTH, dtype=torch.uint8) for _ in range(LAYERS))
             for m in members}
    oracle = KvOracle(SimpleNamespace(page_size=PAGE, members=members), pools)  # type: ignore[arg-type]
    tokens = np.arange(10 * PAGE, dtype="<u4").tobytes()
    pages = {"full": np.arange(10), "swa": np.arange(10, 20), "mamba": np.array([30])}
    oracle.write(tokens, pages, 0)
    return oracle, tokens, pages


def check(oracle: KvOracle, tokens: bytes, pages: dict[str, np.ndarray]) -> tuple[int, int]:
    oracle.wrong_bytes = oracle.pages_missing = 0
    oracle.verify(tokens, pages, 10)
    return oracle.wrong_bytes, oracle.pages_missing


def test_an_honest_reply_has_no_wrong_bytes_and_swa_may_omit_pages_before_its_window(written) -> None:
    oracle, tokens, pages = written
    assert check(oracle, tokens, pages) == (0, 0)
    windowed = {**pages, "swa": np.concatenate([np.full(8, -1), pages["swa"][8:]])}
    assert check(oracle, tokens, windowed) == (0, 0)


@pytest.mark.parametrize(("case", "missing"), [
    ("FULL cut to 2 pages", 8 * LAYERS),
    ("no pages at all", (10 + 2 + 1) * LAYERS),
    ("SWA window all -1", 2 * LAYERS),
    ("no checkpoint", 1 * LAYERS),
])
def test_a_reply_short_of_the_hit_it_claims_is_wrong(written, case: str, missing: int) -> None:
    oracle, tokens, pages = written
    reply = {
        "FULL cut to 2 pages": {**pages, "full": pages["full"][:2]},
        "no pages at all": {},
        "SWA window all -1": {**pages, "swa": np.full(10, -1)},
        "no checkpoint": {**pages, "mamba": np.empty(0, dtype=np.int64)},
    }[case]
    wrong, counted = check(oracle, tokens, reply)
    assert counted == missing and wrong >= missing * WIDTH


def test_a_row_moved_by_the_digests_length_reads_wrong(written) -> None:
    """Rows used to repeat a 32-byte digest: a page whose bytes moved by 32 passed."""
    oracle, tokens, pages = written
    for layer in range(LAYERS):
        rows = oracle.pools["full"][layer].numpy()
        rows[3] = np.roll(rows[3], 32)
    assert check(oracle, tokens, pages)[0] > 0
