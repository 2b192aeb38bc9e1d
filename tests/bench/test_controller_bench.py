"""`hicache bench controller`, tiny: both figures the issue asks for, written as JSON, with
the L3 -> L1 transfer timed apart from the lookup of the match that starts it."""

from __future__ import annotations

import argparse
import json

import pytest

from hicache.bench import controller as bench
from hicache.bench.services import find_binary


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_run_writes_the_figures_and_ratios(tmp_path) -> None:
    if find_binary("redis-server") is None:  # (the serving figure runs a Redis L3)
        pytest.skip("redis-server is not installed")
    out = tmp_path / "controller.json"
    assert bench.run(parse("--tokens", "4096", "--repeat", "2", "--requests", "8",
                           "--json", str(out))) == 0
    data = json.loads(out.read_text())
    load = data["l3_to_l1"]
    assert load["tokens"] == 4096 and load["bytes"] == 4096 * 4 * 256
    assert load["lookup_s"] > 0 and load["ours_s"] > 0 and load["raw_s"] > 0
    assert load["ratio"] == load["ours_s"] / load["raw_s"]
    assert load["ratio_with_lookup"] == load["ours_with_lookup_s"] / load["raw_s"]
    assert set(data["ratios"]) == {"l3_to_l1_vs_raw", "l3_to_l1_with_lookup_vs_raw",
                                   "serving_dead_l3_vs_healthy"}
    assert data["ratios"]["l3_to_l1_vs_raw"] == load["ratio"]
    assert data["serving"]["healthy_us"] > 0 and data["serving"]["dead_us"] > 0
