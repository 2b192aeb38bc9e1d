"""The multi-turn benchmark end to end, tiny: a real daemon, simulated engines over gRPC,
the content oracle and the hit-rate ceiling."""

from __future__ import annotations

import argparse
import json

import pytest

from hicache.bench import multiturn


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    multiturn.add_arguments(p)
    return p.parse_args(list(argv))


def test_ceiling_follows_the_workload_and_the_component_rules() -> None:
    args = parse("--shared-prefix-tokens", "100", "--page-size", "64")
    assert multiturn.ceiling_tokens(0, 0, 0, 612, args) == 0  # nothing cached yet
    assert multiturn.ceiling_tokens(0, 3, 0, 612, args) == 64  # the shared prefix, page-aligned
    assert multiturn.ceiling_tokens(2, 3, 700, 1212, args) == 640  # the previous turn
    hybrid = parse("--shared-prefix-tokens", "100", "--components", "full,swa,mamba")
    assert multiturn.ceiling_tokens(0, 3, 0, 612, hybrid) == 0  # no checkpoint at the prefix end


@pytest.mark.parametrize("components", ["full", "full,swa,mamba"])
def test_l3_run_meets_the_ceiling_with_zero_wrong_bytes(tmp_path, components: str) -> None:
    out = tmp_path / "mt.json"
    args = parse("--clients", "6", "--rounds", "4", "--input-tokens", "128", "--output-tokens", "16",
                 "--shared-prefix-tokens", "128", "--components", components, "--sidecars",
                 # L2 holds a whole prefetch (its share is prefetch_fraction = 0.25 of L2)
                 "--l1-tokens", "1024", "--l2-ratio", "3", "--l3", "file", "--no-progress",
                 "--json", str(out))
    assert multiturn.run(args) == 0
    run = json.loads(out.read_text())["configs"]["run"]
    assert run["wrong_bytes"] == 0 and run["pages_checked"] > 0
    for r in run["rounds"]:
        assert r["hit_rate"] >= 0.995 * r["ceiling"], r
    assert any(r["storage_hit_rate"] > 0 for r in run["rounds"]), "L3 never served"


def test_compare_shows_the_cliff_without_l3(tmp_path) -> None:
    out = tmp_path / "mt.json"
    args = parse("--clients", "6", "--rounds", "4", "--input-tokens", "128", "--output-tokens", "16",
                 "--shared-prefix-tokens", "128", "--l1-tokens", "1024", "--l2-ratio", "1.5",
                 "--compare", "l1,l1+l2+l3", "--no-progress", "--json", str(out),
                 "--plot", str(tmp_path / "mt.png"))
    assert multiturn.run(args) == 0
    configs = json.loads(out.read_text())["configs"]
    last_l1, last_l3 = configs["l1"]["rounds"][-1], configs["l1+l2+l3"]["rounds"][-1]
    assert last_l1["hit_rate"] < 0.5 * last_l1["ceiling"]
    assert last_l3["hit_rate"] >= 0.995 * last_l3["ceiling"]
    assert (tmp_path / "mt.png").stat().st_size > 0


def test_a_daemon_that_cannot_start_is_reported_with_its_log(tmp_path) -> None:
    from hicache.bench.services import serving_daemon

    target = f"unix://{tmp_path / 'd.sock'}"
    with pytest.raises(RuntimeError, match=r"daemon exited \(2\): .*configuration error: no: unknown key"), \
            serving_daemon(["--listen", target, "--set", "no.such=1"], target, tmp_path / "d.log"):
        pass
