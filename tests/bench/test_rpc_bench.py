"""`hicache bench rpc`, tiny, against a real daemon: every figure the issue asks for (empty
call, round, batched round, rounds per second), the target ratios, and the interleaved
ones reported for information, written as JSON."""

from __future__ import annotations

import argparse
import json

from hicache.bench import rpc as bench


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_run_writes_the_figures_and_ratios(tmp_path, capsys) -> None:
    out = tmp_path / "rpc.json"
    assert bench.run(parse("--calls", "64", "--seconds", "0.2", "--processes", "1",
                           "--json", str(out))) == 0
    data = json.loads(out.read_text())
    assert data["prompt_tokens"] == bench.PROMPT_TOKENS and data["batch"] == bench.BATCH
    for name in ("empty_call", "round", "batched_round"):
        assert 0 < data[name]["p50_us"] <= data[name]["p99_us"]
    assert data["empty_call"]["n"] == data["round"]["n"] == 64
    assert data["batched_round"]["n"] >= 20  # (at least 20 batches, per round each)
    assert set(data["rounds_per_s"]) == {"1"} and data["rounds_per_s"]["1"] > 0
    ratios = data["ratios"]
    assert ratios["round_vs_empty"] == data["round"]["p50_us"] / data["empty_call"]["p50_us"]
    assert ratios["batched_round_vs_empty"] == (
        data["batched_round"]["p50_us"] / data["empty_call"]["p50_us"])
    mixed = data["interleaved"]
    assert mixed["empty_call"]["n"] == mixed["round"]["n"] == 64
    assert data["ratios_interleaved"]["round_vs_empty"] == (
        mixed["round"]["p50_us"] / mixed["empty_call"]["p50_us"])
    printed = capsys.readouterr().out
    assert "round / empty call:" in printed and "(target <= 2.5x)" in printed
    assert "interleaved call by call" in printed
