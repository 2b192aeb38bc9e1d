"""`hicache bench tree`, tiny: the figures the issue asks for, a pool that never leaks
and interleaved rounds."""

from __future__ import annotations

import argparse
import json

import pytest

from hicache.bench import tree as bench


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("spec", ["full", "full,swa,mamba"])
def test_workload_under_eviction_accounts_for_every_page(spec: str) -> None:
    # 4 conversations of up to 2K + 6 x 1K tokens (128 pages) in a 16K-token budget
    # (256 pages): evictions in the later turns; run_workload checks the tree's integrity and that every page id is free or
    # held by the tree at the end.
    f = bench.run_workload(64, spec, 16384, conversations=4, turns=6)
    assert f.requests == 24 and f.evictions > 0
    assert f.match_us_mean > 0 and f.insert_us_mean > 0 and f.evict_us_mean > 0
    assert 0 < f.metadata_bytes_per_page < 1000


def test_hybrid_resumes_where_full_does_under_eviction() -> None:
    # Once a conversation's tail is evicted, FULL resumes at the shared system prompt. The
    # simulated hybrid engine keeps a MAMBA checkpoint at that junction the first time it
    # recomputes through it, so it resumes there too and both configurations do the same
    # work (the ratio compares like with like).
    full = bench.run_workload(64, "full", 16384, conversations=4, turns=6)
    hybrid = bench.run_workload(64, "full,swa,mamba", 16384, conversations=4, turns=6)
    assert full.reused_tokens_mean >= 2048
    assert hybrid.reused_tokens_mean >= 0.9 * full.reused_tokens_mean


def test_side_by_side_runs_do_the_same_work_as_runs_alone() -> None:
    # Pairing only changes when each request runs, not what it does: the same requests,
    # boundaries, evictions and tree, whichever configuration runs beside it.
    alone = [bench.run_workload(64, spec, 16384, conversations=4, turns=6) for spec in ("full", "full,swa,mamba")]
    paired = bench.run_paired(64, 16384, conversations=4, turns=6)
    for a, p in zip(alone, paired, strict=True):
        assert (p.components, p.requests, p.evictions, p.reused_tokens_mean, p.metadata_bytes_per_page) == (
            a.components, a.requests, a.evictions, a.reused_tokens_mean, a.metadata_bytes_per_page)


def test_run_writes_the_figures_and_ratios(tmp_path) -> None:
    out = tmp_path / "tree.json"
    assert bench.run(parse("--quick", "--conversations", "3", "--turns", "2", "--rounds", "2",
                           "--json", str(out))) == 0
    data = json.loads(out.read_text())
    assert [(c["page_size"], c["components"]) for c in data["configs"]] == [(64, "full"), (64, "full,swa,mamba")]
    for c in data["configs"]:
        for key in ("budget_tokens", "match_us_mean", "match_us_p99", "insert_us_mean",
                    "insert_us_p99", "evict_us_mean", "metadata_bytes_per_page"):
            assert c[key] >= 0, key
    assert set(data["ratios"]) == {"hybrid_vs_full_match_p64_2000000", "hybrid_vs_full_insert_p64_2000000"}
    for key, value in data["ratios"].items():  # the median of the rounds' ratios
        rounds = data["ratio_rounds"][key]
        assert len(rounds) == 2 and min(rounds) <= value <= max(rounds)


def test_counts_below_one_are_usage_errors_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--rounds", "--conversations", "--turns"):
        with pytest.raises(SystemExit) as exit_:
            parse(flag, "0")
        assert exit_.value.code == 2
        assert f"argument {flag}: 0 (at least 1)" in capsys.readouterr().err
