"""Mutation review, third round (command line): what `hicache config check` prints that
no other test pinned. Each test names the mutant of the product code it kills; every one
passes on the product as it is. Real `hicache.cli.main` on the embedded defaults."""

from __future__ import annotations

from hicache.cli import main


def test_config_check_prints_l2_tokens_and_a_kibibyte_in_kibibytes(capsys) -> None:
    """`hicache config check` with a FULL member of 16 bytes per token per layer (page 64
    tokens: exactly 1024 bytes a page a layer, 4 layers) and L1 of 6400 tokens prints the
    1024-byte row as "1.0 KiB" (not "1024 B"), and L2 (ratio 2: 200 pages) in L2's own
    tokens, 12800, with its bytes, 200 x 4.0 KiB = 800.0 KiB.
    Mutants killed: `_human_bytes` with `abs(n) <= 1024` (a whole KiB printed in bytes),
    and the l2_pages line counting L1's pages' tokens (6400)."""
    assert main(["config", "check", "--set", "tiers.l1.tokens=6400",
                 "--set", "model.components.full.bytes_per_token_per_layer=16"]) == 0
    out = capsys.readouterr().out
    assert "l1_pages: 100 (6400 tokens)" in out
    assert "l2_pages: 200 (12800 tokens)" in out
    assert ("member full: component=full layers=4 page=1.0 KiB/layer "
            "l1=100 x 4.0 KiB = 400.0 KiB l2=200 x 4.0 KiB = 800.0 KiB") in out
    assert "l1_bytes: 400.0 KiB" in out
    assert "l2_bytes: 800.0 KiB" in out
