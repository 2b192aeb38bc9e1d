"""Mutation review (session 31) of the tier helpers: row plans, pool checks, sizing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tierkit import TINY, tiny_config

from hicache.config import build_config
from hicache.errors import FailedPrecondition, InvalidArgument
from hicache.tiers.copy import CpuCopyEngine
from hicache.tiers.device import ShmDevicePools
from hicache.tiers.host import HostBufferPools
from hicache.tiers.rows import PlanKind, RowPlan, plan_rows
from hicache.tiers.sizing import mem_available_bytes
from hicache.types import ComponentKind

FULL = ComponentKind.FULL


def i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _contiguous(ids: np.ndarray) -> bool:
    return bool(np.all(np.diff(ids) == 1))


def _assert_plan_contract(plan: RowPlan) -> None:
    """Within each run, the side(s) the plan's kind moves as one block are contiguous."""
    for lo, hi in plan.runs:
        src, dst = plan.src_ids[lo:hi], plan.dst_ids[lo:hi]
        if plan.kind in (PlanKind.RUNS, PlanKind.SCATTER):
            assert _contiguous(src), (plan.kind, src.tolist())
        if plan.kind in (PlanKind.RUNS, PlanKind.GATHER):
            assert _contiguous(dst), (plan.kind, dst.tolist())


@pytest.mark.parametrize(
    ("src", "dst", "kind"),
    [
        (i64(5, 4, 7), i64(0, 1, 2), PlanKind.GATHER),  # (free-list order: 7 - 5 == 3 - 1)
        (i64(0, 0, 2), i64(3, 4, 5), PlanKind.GATHER),  # a repeated source
        (i64(0, 1, 2), i64(9, 8, 11), PlanKind.SCATTER),
        (i64(6, 6), i64(1, 2), PlanKind.GATHER),
    ],
)
def test_three_ids_whose_ends_are_two_apart_are_not_taken_for_a_run(
    src: np.ndarray, dst: np.ndarray, kind: PlanKind
) -> None:
    """A short batch like L2 pages [5, 4, 7] spans as far as a run but is none: the plan
    (which the CUDA staging path makes for copies of any size) must not move it as one
    block, which would copy pages 5, 6, 7 (another request's KV) into the engine's rows."""
    # Mutant: rows._is_run checking every step only from 4 ids on (`n < 4`).
    plan = plan_rows(src, dst)
    assert plan.kind is kind
    _assert_plan_contract(plan)


def test_a_copy_between_pools_of_other_family_members_is_refused(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    """L1 and L2 pools built from two configurations whose FULL family differs (here the
    sidecar has another layer count) do not hold the same rows: a copy between them is
    refused before a byte moves, naming the family."""
    # Mutant: validate_copy without its family-members check.
    other = {**TINY, "model": {**TINY["model"], "sidecars": {
        "idx": {"anchor": "full", "layers": 2, "bytes_per_token_per_layer": 2}}}}
    cfg = tiny_config()
    dev, host = make_device(cfg), make_host(build_config({**other, "tiers": {
        **TINY["tiers"], "l2": {**TINY["tiers"]["l2"], "layout": "layer_first"}}}))
    engine = CpuCopyEngine(dev, host)
    try:
        with pytest.raises(InvalidArgument, match="full: L1 and L2 hold different family members"):
            engine.device_to_host(FULL, i64(0), i64(0))
        with pytest.raises(InvalidArgument, match="full: L2 and L1 hold different family members"):
            engine.host_to_device(FULL, i64(0), i64(0))
    finally:
        engine.close()


def test_mem_available_is_read_in_bytes_from_meminfo(tmp_path: Path) -> None:
    """/proc/meminfo counts kB: the L2 fit check compares bytes, so MemAvailable is
    scaled (a host with 16 GiB free is not read as 16 MiB); no such line is an error."""
    # Mutant: mem_available_bytes without `* 1024`.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   16777216 kB\n")
    assert mem_available_bytes(meminfo) == 16 << 30
    meminfo.write_text("MemTotal:       32000000 kB\n")
    with pytest.raises(FailedPrecondition, match="no MemAvailable line"):
        mem_available_bytes(meminfo)


def test_a_negative_layer_is_refused_not_read_from_the_end(
    make_device: Callable[..., ShmDevicePools], make_host: Callable[..., HostBufferPools]
) -> None:
    """Layer -1 is out of range in L1 and L2 alike: it must not index the last layer
    (a caller would read or write another layer's KV without an error)."""
    # Mutant: MemberTable.checked_layer without `0 <=`.
    cfg = tiny_config()
    for pools in (make_device(cfg), make_host(cfg)):
        with pytest.raises(InvalidArgument, match=r"full: layer -1 out of range \[0, 2\)"):
            pools.layer_array("full", -1)
        assert pools.layer_array("full", 1).shape[0] == pools.num_pages(FULL)


def test_pools_without_a_page_count_for_a_configured_component_are_refused() -> None:
    """Pools are built from members and a page count per component: one missing is an
    InvalidArgument naming the tier and the component, not a KeyError from deep inside."""
    # Mutant: MemberTable.__init__ without its missing-page-count check.
    from hicache.tiers.members import MemberTable

    members = tiny_config().model.members
    with pytest.raises(InvalidArgument, match=r"L2: no page count for components \['mamba'\]"):
        MemberTable(members, {FULL: 32}, "L2")
    with pytest.raises(InvalidArgument, match="L2: no member pools configured"):
        MemberTable((), {FULL: 32}, "L2")
    table = MemberTable(members, {FULL: 32, ComponentKind.MAMBA: 8}, "L2")
    assert (table.num_pages(FULL), table.num_pages(ComponentKind.MAMBA)) == (32, 8)
