"""Review: the Mooncake L3 backend under memory pressure and sharing.

A store whose global segment is small, so Mooncake refuses puts (this Mooncake build,
0.3.13.post1, never evicts to make room here: a full segment refuses `-200` until
objects are removed); two clients on one master, one closing (objects are placed in any
mounted segment: what the closing one's segment held disappears for the other); the
configured segment size against what Mooncake accepts. Checked: counters, health, the
write breaker and the existence cache stay truthful; nothing wrong is ever served.

Real `mooncake_master` processes (`tests/services.py`), real backends, and in-process
controllers (`tests/controller/engine_sim.py`: its engine writes and checks KV bytes).
Tests marked `xfail(strict=True)` expose a bug (the reason says which); the others pin
behaviour no other test covers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from storage_pages import Pool, keys, storage_config

from hicache.bench.services import MooncakeMaster
from hicache.config import load_config
from hicache.controller.base import MatchRequest, PrefetchState
from hicache.controller.storage_io import L3Store
from hicache.errors import BackendUnavailable, ConfigError
from hicache.tiers.storage import GetStatus, PutStatus, StorageBackend, build_backend
from hicache.types import StorageBackendName, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "controller"))
from engine_sim import Engine, built_controllers, evict_all, seq, wait_prefetch

SEG = 16 << 20  # the smallest segment this Mooncake build accepts
# Masters that never evict (the default evicts 5% of objects in the background once 90%
# full): what a test stores stays, so what is refused is the store's answer alone.
QUIET = ("--eviction_ratio=0",)
PS = 4  # tiny_config's page size
# A page object of 4 tokens x 2 layers x 32 KiB = 256 KiB (+ header): ~56 fit in SEG.
PAGE_BYTES_PER_TOKEN_LAYER = 32 << 10


# ------------------------------------------------------------------------- helpers


def _backend(master: MooncakeMaster, segment: int = SEG) -> StorageBackend:
    cfg = storage_config(StorageBackendName.MOONCAKE, mooncake_master=master.master,
                         mooncake_metadata=master.metadata_server)
    mc = cfg.mooncake.__class__(**{**cfg.mooncake.__dict__, "global_segment_size": segment,
                                   "local_buffer_size": 4 << 20})
    return build_backend(cfg.__class__(**{**cfg.__dict__, "mooncake": mc}))  # (started)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    with built_controllers(tmp_path, prefix="mp") as factory:
        yield factory


def _controller(make: Callable[..., Any], master: MooncakeMaster, **kw: Any) -> Any:
    return make(
        backend="mooncake",
        l1_tokens=512,
        storage__timeout_s=5.0,
        storage__mooncake={
            "master": master.master,
            "metadata_server": master.metadata_server,
            "global_segment_size": SEG,
            "local_buffer_size": 4 << 20,
        },
        model__components={"full": {"layers": 2,
                                    "bytes_per_token_per_layer": PAGE_BYTES_PER_TOKEN_LAYER}},
        write__l1_to_l2="write_through",
        write__l2_to_l3="write_through",
        **kw,
    )


def _keys_of(ctl: Any, eng: Engine, tokens: bytes) -> list[str]:
    return ctl.l3.keys(eng.ns, eng.hashes(tokens), ctl.cfg.model.members)


def _present(backend: StorageBackend, ks: list[str]) -> list[bool]:
    return list(backend._exists(ks))  # (the raw per-key answer, not a prefix)


# ======================================================================= backends


def test_a_full_segment_refuses_puts_per_key_and_a_key_another_client_holds_is_present(
    mooncake_factory: Callable[..., MooncakeMaster],
) -> None:
    """Two clients on a private master. A fills the pool until puts are refused: each
    refusal is FAILED and counted, never an outage, and the store's existence answer
    agrees with what was STORED. B then puts the same keys: those A stored are PRESENT
    (not rewritten, not counted stored), the others FAILED; B reads A's objects
    byte-exact."""
    master = mooncake_factory(*QUIET)
    a, b = _backend(master), _backend(master)
    try:
        n = 160  # 40 MiB of objects for 32 MiB of segments
        src = Pool(n, payload=256 << 10, seed=3).register(a)
        b.register_host_buffer(src.memory.ctypes.data, src.memory.nbytes)
        ks = keys(n)
        statuses: list[PutStatus] = []
        for lo in range(0, n, 16):
            statuses += a.put_from(ks[lo:lo + 16], src.slots(range(lo, lo + 16)))
        stored = [s is PutStatus.STORED for s in statuses]
        assert 0 < sum(stored) < n and PutStatus.PRESENT not in statuses
        assert a.stats().put_failed == n - sum(stored) and a.stats().unavailable == 0
        assert _present(a, ks) == stored
        again = b.put_from(ks, src.slots())
        assert [s is PutStatus.PRESENT for s in again] == stored
        assert all(s is PutStatus.FAILED for s, was in zip(again, stored, strict=True) if not was)
        sb = b.stats()
        assert (sb.stored, sb.present, sb.put_failed, sb.bytes_written) == (
            0, sum(stored), n - sum(stored), 0)
        dst = Pool(n, payload=256 << 10, seed=None).register(b)
        got = b.get_into(ks, dst.slots())
        for i, status in enumerate(got):
            assert status is (GetStatus.HIT if stored[i] else GetStatus.MISS)
            if stored[i]:
                assert (dst.pages[i] == src.pages[i]).all()
        assert b.stats().corrupt == 0
        assert a.health().healthy and b.health().healthy
    finally:
        b.close(5.0)
        a.close(5.0)


def test_a_client_closing_takes_its_segment_and_the_other_reads_misses_never_wrong_bytes(
    mooncake_factory: Callable[..., MooncakeMaster],
) -> None:
    """A stores 32 objects (placed over both segments); A closes. B's existence answers
    and reads agree per key (what stayed is byte-exact, what left is a miss, nothing is
    corrupt, no call fails) and B's puts of the lost keys are STORED again."""
    master = mooncake_factory(*QUIET)
    a, b = _backend(master), _backend(master)
    try:
        n = 32
        src = Pool(n, payload=64 << 10, seed=5).register(a)
        ks = keys(n)
        assert a.put_from(ks, src.slots()) == [PutStatus.STORED] * n
        assert a.close(10.0)
        there = _present(b, ks)
        dst = Pool(n, payload=64 << 10, seed=None).register(b)
        got = b.get_into(ks, dst.slots())
        assert [g is GetStatus.HIT for g in got] == there
        assert not all(there)  # (objects went to A's segment too)
        for i in range(n):
            if there[i]:
                assert (dst.pages[i] == src.pages[i]).all()
        copy = Pool(n, payload=64 << 10, seed=5).register(b)
        again = b.put_from(ks, copy.slots())
        assert [s is PutStatus.PRESENT for s in again] == there
        assert [s is PutStatus.STORED for s in again] == [not t for t in there]
        assert _present(b, ks) == [True] * n
        s = b.stats()
        assert (s.corrupt, s.unavailable) == (0, 0)
    finally:
        b.close(5.0)
        a.close(5.0)


# ==================================================================== controllers


def _overfilled(make: Callable[..., Any], master: MooncakeMaster) -> tuple[Any, Engine, bytes, int]:
    """A controller alone on `master` (its segment is the whole pool) after one request
    of 80 pages of 256 KiB: about 56 fit. Returns (ctl, engine, prompt, pages stored)."""
    ctl = _controller(make, master)
    eng = Engine(ctl)
    prompt = seq(80, 1000)
    eng.request(prompt)
    assert ctl.transfers.drain(30)
    stored = sum(_present(ctl.l3.backend, _keys_of(ctl, eng, prompt)))
    assert 0 < stored < 80
    return ctl, eng, prompt, stored


@pytest.mark.timeout(60)
def test_a_partly_stored_backup_serves_what_landed_and_promises_no_more(
    make: Callable[..., Any], mooncake_factory: Callable[..., MooncakeMaster],
) -> None:
    """The segment refused the tail of a backup: the backup is given up (counted
    `backups_l3_failed`), never an L3 outage (no error, read breaker closed); the pages
    stored are counted `backups_l3` exactly once; after L1 and L2 are emptied a lookup
    promises exactly the stored prefix and a prefetch brings it back byte-exact."""
    ctl, eng, prompt, stored = _overfilled(make, mooncake_factory(*QUIET))
    c = ctl.stats().counters
    assert c["backups_l3"] == stored and c["backups_l3_failed"] == 1
    assert ctl.l3.errors == 0 and not ctl.l3.breaker.is_open
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True, prefetch=True))
    assert m.storage_tokens == stored * PS and m.prefetch_id
    assert wait_prefetch(ctl, m.prefetch_id, 20) is PrefetchState.DONE
    assert ctl.prefetch_status(m.prefetch_id).tokens_ready == stored * PS
    ctl.release("e1", m.lock_id, None)
    m = ctl.match("e1", MatchRequest("", prompt, lock=True))
    assert m.device_tokens + m.host_tokens == stored * PS and m.storage_tokens == 0
    eng.verify(m.device_pages, prompt, m.device_tokens // PS)
    if m.host_tokens:  # (a prefetch into free L1 pages may have brought them all up)
        *_, last = list(ctl.load("e1", m.lock_id))
        eng.verify(last.device_pages, prompt, last.device_tokens // PS)
    assert eng.checked > 0
    ctl.release("e1", m.lock_id, None)
    assert ctl.l3.backend.stats().corrupt == 0


@pytest.mark.timeout(60)
def test_a_retried_partial_backup_does_not_count_its_own_pages_as_present(
    make: Callable[..., Any], mooncake_factory: Callable[..., MooncakeMaster],
) -> None:
    """No other client ever wrote to this master: nothing may be `backups_l3_present`
    (was: 56 stored, 280 present)."""
    ctl, _eng, _prompt, stored = _overfilled(make, mooncake_factory(*QUIET))
    c = ctl.stats().counters
    assert c["backups_l3"] == stored
    assert c["backups_l3_present"] == 0, (stored, c["backups_l3_present"])
    # (Each retry writes every page again, so that the store keeps the pages stored
    # before: the backend counts what the store answered, PRESENT for those.)
    assert ctl.l3.backend.stats().present > 0


class _Host:
    """What L3Store asks of the host pools: a view of each page's object."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def object_views(self, member: str, ids: Any) -> list[Any]:
        return [self.pool.pages[i] for i in list(ids)]


def test_the_write_probe_of_a_store_that_refuses_pages_does_not_reopen_writes(
    mooncake_factory: Callable[..., MooncakeMaster],
) -> None:
    """The segment fills with 1 MiB page objects (puts refused -200, FAILED); three
    refused backups open the write breaker. The canary that would close it must prove
    what backups need: that a page object fits, not a small one."""
    master = mooncake_factory(*QUIET)
    backend = _backend(master)
    try:
        n = 20
        pool = Pool(n, payload=1 << 20, seed=9).register(backend)
        l3 = L3Store(backend, _Host(pool), "pressure-model")  # type: ignore[arg-type]
        members = tiny_members()
        hashes = [i.to_bytes(16, "little") for i in range(n)]
        for i in range(n):
            with contextlib.suppress(Exception):  # (refused: BackendUnavailable / BreakerOpen)
                l3.write("", hashes[i:i + 1], members, [i])
        assert l3.write_breaker.is_open and not l3.breaker.is_open
        page = Pool(1, payload=1 << 20, seed=10)
        # The canary is a page object's size (was 4 KiB, which fits where pages do not).
        # Whether it fits now is the store's to say (Mooncake evicts in the background).
        sizes: list[int] = []
        write = backend._write_from

        def recorded(ks: Any, buffers: Any) -> Any:
            sizes.extend(b.nbytes for b in buffers)
            return write(ks, buffers)

        backend._write_from = recorded  # type: ignore[method-assign]
        reopened = l3.probe_writes()
        assert sizes and min(sizes) >= page.slots()[0].nbytes, sizes
        assert reopened is l3.takes_writes
    finally:
        backend.close(5.0)


def tiny_members() -> tuple[Any, ...]:
    from hicache.config import MemberSpec
    from hicache.types import ComponentKind

    return (MemberSpec(name="full", component=ComponentKind.FULL, anchor=ComponentKind.FULL,
                       layers=1, bytes_per_page_per_layer=1 << 20, window_tokens=0),)


# ========================================================================= config


def test_a_segment_mooncake_cannot_mount_is_refused_by_the_config_or_named_at_start(
    mooncake_master: MooncakeMaster,
) -> None:
    env = {"MOONCAKE_MASTER": mooncake_master.master,
           "MOONCAKE_TE_META_DATA_SERVER": mooncake_master.metadata_server,
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(8 << 20)}
    try:
        cfg = load_config(None, ["storage.backend=mooncake"], env=env)
    except ConfigError as e:
        assert "MOONCAKE_GLOBAL_SEGMENT_SIZE" in str(e) or "global_segment_size" in str(e)
        return
    assert cfg.storage.mooncake.global_segment_size == 8 << 20  # (the env var applied)
    with pytest.raises(BackendUnavailable) as e:
        build_backend(cfg.storage).close(5.0)
    # Observed: "mooncake: setup() returned -600 (master ...)".
    assert "global_segment_size" in str(e.value), str(e.value)


def test_the_environment_and_the_yaml_combine_into_the_store_the_backend_mounts(
    mooncake_master: MooncakeMaster,
) -> None:
    """MOONCAKE_MASTER / _TE_META_DATA_SERVER / _GLOBAL_SEGMENT_SIZE fill the null keys,
    a YAML value wins (protocol), and the backend mounts that segment: its health
    reports the segment size from the environment as its capacity."""
    env = {"MOONCAKE_MASTER": mooncake_master.master,
           "MOONCAKE_TE_META_DATA_SERVER": mooncake_master.metadata_server,
           "MOONCAKE_PROTOCOL": "rdma",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(SEG + 4096)}
    cfg = load_config(None, ["storage.backend=mooncake", "storage.mooncake.protocol=tcp",
                             "storage.mooncake.local_buffer_size=4194304"], env=env)
    mc = cfg.storage.mooncake
    assert (mc.master, mc.protocol, mc.global_segment_size) == (
        mooncake_master.master, "tcp", SEG + 4096)
    backend = build_backend(cfg.storage)  # (started)
    try:
        health = backend.health(deep=True)
        assert health.healthy and health.capacity_bytes == SEG + 4096
    finally:
        backend.close(5.0)
