"""Review of the day's changes (c24c2b0..HEAD): `Transfers.allocate_l1_all`, the registry
of running loads (`_loads`, the wait of a second load), tensor parallelism on shared
memory (rows holding every rank's shard, `descriptors(tp_rank)`, the client's strided
views), and the configuration changes (redact_url, the port rule, the YAML 1.2 floats).

Tests marked xfail(strict=True) are bugs this review found.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from engine_sim import CopyGate, Loader, evict_all, flushed, seq, toks, wait_prefetch

from hicache.config import ConfigError, load_config, redact_url
from hicache.controller import loads as loads_mod
from hicache.controller.base import InsertRequest, MatchRequest
from hicache.errors import InvalidArgument, NotFound, ResourceExhausted
from hicache.keys import chain_hashes
from hicache.tiers.device import attach_device_pools
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA


# ---------------------------------------------------------------------- helpers


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def loads_running(ctl) -> int:  # type: ignore[no-untyped-def]
    with ctl._mu:
        return len(ctl.loads._loads)


def pattern(page_hash: bytes, member: str, layer: int, rank: int, size: int) -> np.ndarray:
    seed = hashlib.sha256(page_hash + member.encode() + bytes([layer, rank])).digest()
    return np.frombuffer((seed * (size // 32 + 1))[:size], dtype=np.uint8)


class TpGroup:
    """One engine id, one attach per rank; each rank maps its own views (the client's
    `attach_device_pools(descs, members)`) and writes bytes of its own."""

    def __init__(self, ctl, engine_id: str = "tp") -> None:  # type: ignore[no-untyped-def]
        self.ctl, self.id = ctl, engine_id
        self.tp = ctl.cfg.model.tp_size
        self.ps = ctl.cfg.model.page_size
        self.infos = [ctl.attach(engine_id, r, self.tp) for r in range(self.tp)]
        self.pools = [attach_device_pools(i.pools, i.members) for i in self.infos]

    def hashes(self, tokens: bytes) -> list[bytes]:
        blob = chain_hashes(self.ctl.cfg.model.chain_seed(""), tokens, self.ps * 4)
        return [blob[i : i + 16] for i in range(0, len(blob), 16)]

    def write(self, pages: dict[str, np.ndarray], tokens: bytes) -> None:
        hs = self.hashes(tokens)
        for rank, (info, pools) in enumerate(zip(self.infos, self.pools, strict=True)):
            for m in info.members:
                for layer in range(m.layers):
                    rows = pools[m.name][layer]
                    assert tuple(rows.shape) == (rows.shape[0], m.bytes_per_page_per_layer)
                    if m.component is MAMBA:
                        rows[int(pages[m.name][0])] = torch_of(
                            pattern(hs[-1] + b"state", m.name, layer, rank, rows.shape[1]))
                        continue
                    for i, pid in enumerate(pages[m.name]):
                        rows[int(pid)] = torch_of(pattern(hs[i], m.name, layer, rank, rows.shape[1]))

    def verify(self, pages: dict[str, np.ndarray], tokens: bytes, n_pages: int) -> int:
        """Every rank's shard of every page, through that rank's own views; and the
        daemon's row is the ranks' shards side by side. Returns the checks made."""
        hs = self.hashes(tokens)
        checked = 0
        for rank, (info, pools) in enumerate(zip(self.infos, self.pools, strict=True)):
            for m in info.members:
                ids = pages[m.name]
                for layer in range(m.layers):
                    rows = pools[m.name][layer]
                    row_of = self.ctl.device.layer(m.name, layer).numpy()
                    w = m.bytes_per_page_per_layer
                    if m.component is MAMBA:
                        assert len(ids) == 1, (m.name, ids)
                        want = pattern(hs[n_pages - 1] + b"state", m.name, layer, rank, w)
                        assert np.array_equal(rows[int(ids[0])].numpy(), want), f"rank {rank} {m.name}"
                        assert np.array_equal(row_of[int(ids[0])][rank * w : (rank + 1) * w], want)
                        checked += 1
                        continue
                    assert len(ids) == n_pages, (m.name, len(ids), n_pages)
                    for i, pid in enumerate(ids):
                        if pid < 0:
                            continue
                        want = pattern(hs[i], m.name, layer, rank, w)
                        assert np.array_equal(rows[int(pid)].numpy(), want), (
                            f"rank {rank} {m.name} page {i} layer {layer} wrong")
                        assert np.array_equal(row_of[int(pid)][rank * w : (rank + 1) * w], want)
                        checked += 1
        return checked


def torch_of(a: np.ndarray):  # type: ignore[no-untyped-def]
    import torch

    return torch.from_numpy(a.copy())


def tokens_of(n_pages: int, ps: int, base: int = 0) -> bytes:
    return toks(np.arange(base, base + n_pages * ps))


# ---------------------------------------------------------------------- tensor parallelism


TP_GEOMETRIES = {
    # The hybrid model (FULL + SWA + MAMBA, an indexer and a conv sidecar) of the tiny config.
    "hybrid": dict(hybrid=True),
    # Page size 1, one layer, one byte per token and rank: a shard is a single byte.
    "page1-layer1": dict(model__page_size=1, l1_tokens=64,
                         model__components={"full": {"layers": 1, "bytes_per_token_per_layer": 1}}),
}


@pytest.mark.parametrize("geometry", list(TP_GEOMETRIES))
def test_tp2_every_ranks_shard_survives_l2_and_l3_and_comes_back_by_load(make, geometry: str) -> None:
    ctl = make(model__tp_size=2, write__l1_to_l2="write_through", write__l2_to_l3="write_through",
               **TP_GEOMETRIES[geometry])
    g = TpGroup(ctl)
    n = 6
    a = tokens_of(n, g.ps, base=100)
    m = ctl.match("tp", MatchRequest("", a, lock=True, allocate_tokens=len(a) // 4))
    g.write(m.pages, a)
    g.verify(m.pages, a, n)  # (the ranks' views do not overlap)
    out = ctl.insert("tp", InsertRequest("", a, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                         mamba_checkpoint=True))
    assert out.inserted_tokens == n * g.ps
    flushed(ctl, a)
    # L2 only: Load brings every rank's shard back.
    evict_all(ctl, Tier.DEVICE)
    hit = ctl.match("tp", MatchRequest("", a, lock=True))
    assert (hit.device_tokens, hit.host_tokens) == (0, n * g.ps)
    final = list(ctl.load("tp", hit.lock_id))[-1]
    assert final.device_tokens == n * g.ps
    assert g.verify(final.device_pages, a, n)
    ctl.release("tp", hit.lock_id, None)
    # L3 only: prefetch to L2, then Load.
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    p = ctl.match("tp", MatchRequest("", a, lock=True, prefetch=True))
    assert p.storage_tokens == n * g.ps and p.prefetch_id
    wait_prefetch(ctl, p.prefetch_id)
    ctl.release("tp", p.lock_id, None)
    back = ctl.match("tp", MatchRequest("", a, lock=True))
    assert back.device_tokens + back.host_tokens == n * g.ps  # (a prefetch may land in L1)
    final = list(ctl.load("tp", back.lock_id))[-1]
    assert final.device_tokens == n * g.ps
    assert g.verify(final.device_pages, a, n)
    ctl.release("tp", back.lock_id, None)
    assert loads_running(ctl) == 0


def test_tp2_descriptors_of_a_rank_out_of_range_are_invalid_argument(make) -> None:
    ctl = make(model__tp_size=2, storage__backend="none")
    for rank in (-1, 2, 7):
        with pytest.raises(InvalidArgument):
            ctl.device.descriptors(rank)
        with pytest.raises(InvalidArgument):
            ctl.attach("bad", rank, 2)
    with pytest.raises(InvalidArgument):
        ctl.attach("bad", 0, 1)  # (tp_size must match the model's)
    d0, d1 = ctl.device.descriptors(0), ctl.device.descriptors(1)
    for a, b, spec in zip(d0, d1, ctl.cfg.model.members, strict=True):
        assert b.offset_bytes - a.offset_bytes == spec.bytes_per_page_per_layer // 2
        assert a.page_stride_bytes == b.page_stride_bytes == spec.bytes_per_page_per_layer


def test_tp1_maps_whole_rows_with_or_without_the_members(make) -> None:
    """tp 1 is unchanged: rank 0 only, no offset; a caller that passes no members (the
    old signature) maps whole rows too."""
    ctl = make(hybrid=True, storage__backend="none")
    info = ctl.attach("one", 0, 1)
    assert info.members == ctl.cfg.model.members
    with pytest.raises(InvalidArgument):
        ctl.device.descriptors(1)
    with_members = attach_device_pools(info.pools, info.members)
    without = attach_device_pools(info.pools)
    for m in ctl.cfg.model.members:
        for layer in range(m.layers):
            assert tuple(with_members[m.name][layer].shape) == tuple(without[m.name][layer].shape) == (
                ctl.device.num_pages(m.component), m.bytes_per_page_per_layer)
            with_members[m.name][layer][1] = 7
            assert int(ctl.device.layer(m.name, layer)[1].sum()) == 7 * m.bytes_per_page_per_layer


# ---------------------------------------------------------------------- allocate_l1_all


def test_allocate_l1_all_raising_midway_frees_what_it_took(make, monkeypatch) -> None:
    """The slow path (a kind short of free pages) allocates kind by kind: a failure on a
    later kind gives back what the earlier ones took; no page leaks."""
    from engine_sim import Engine

    ctl = make(hybrid=True, l1_tokens=32, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    eng.request(seq(8, base=1000))  # L1's 8 FULL pages, unlocked
    assert ctl.transfers.drain(10)
    t = ctl.transfers
    original = t._allocate
    calls: list = []

    def failing(tier, kind, n, **kw):  # type: ignore[no-untyped-def]
        calls.append(kind)
        if kind is not FULL:
            raise ResourceExhausted("injected")
        return original(tier, kind, n, **kw)

    monkeypatch.setattr(t, "_allocate", failing)
    with ctl._mu:
        assert ctl.device.allocator(FULL).free_count == 0
        with pytest.raises(ResourceExhausted, match="injected"):
            t.allocate_l1_all({FULL: 2, SWA: 2})
        assert calls[0] is FULL and len(calls) == 2
        for kind in (FULL, SWA, MAMBA):
            alloc = ctl.device.allocator(kind)
            assert alloc.free_count + ctl.tree.resident_pages(Tier.DEVICE, kind) == alloc.total, kind
    monkeypatch.setattr(t, "_allocate", original)
    ctl.check_integrity()


def test_a_hybrid_allocation_without_a_mamba_slot_evicts_nothing(make) -> None:
    """`_allocate_family` (MatchPrefix with allocate_tokens) short of a MAMBA slot: the
    FULL pages it could evict for stay in L1."""
    ctl = make(hybrid=True, l1_tokens=32, write__l1_to_l2="write_through", storage__backend="none")
    from engine_sim import Engine

    eng = Engine(ctl)
    eng.request(seq(8, base=1000), checkpoint=False)  # 8 unlocked FULL pages fill L1
    assert ctl.transfers.drain(10)
    holds = []
    while ctl.device.allocator(MAMBA).free_count:
        holds.append(ctl.match("e1", MatchRequest("", seq(1, base=5000 + 10 * len(holds)),
                                                  lock=True, allocate_tokens=0)))
    evicted = ctl.stats().counters.get("evictions_device", 0)
    try:
        with pytest.raises(ResourceExhausted, match="mamba"):
            ctl.match("e1", MatchRequest("", seq(2, base=9000), lock=True, allocate_tokens=8))
        assert ctl.stats().counters.get("evictions_device", 0) == evicted
        with ctl._mu:
            assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 8
        ctl.check_integrity()
    finally:
        for h in holds:
            ctl.release("e1", h.lock_id, h.allocation_id)


# ---------------------------------------------------------------------- the loads' registry


def _two_locks_on_one_l2_path(make, **kw):  # type: ignore[no-untyped-def]
    from engine_sim import Engine

    ctl = make(write__l1_to_l2="write_through", storage__backend="none", **kw)
    eng = Engine(ctl)
    a = seq(4, base=300)
    eng.request(a)
    evict_all(ctl, Tier.DEVICE)
    Engine(ctl, "x")
    Engine(ctl, "y")
    mx = ctl.match("x", MatchRequest("", a, lock=True))
    my = ctl.match("y", MatchRequest("", a, lock=True))
    assert mx.host_tokens == my.host_tokens == 16
    return ctl, eng, a, mx, my


def test_a_lock_released_while_its_load_waits_is_not_found_and_takes_nothing(make) -> None:
    ctl, eng, a, mx, my = _two_locks_on_one_l2_path(make)
    gate = CopyGate(ctl)
    try:
        lx = gate.held_load("x", mx.lock_id)
        ly = Loader(ctl, "y", my.lock_id)
        ly.start()
        time.sleep(0.2)  # (y waits for x's copy)
        assert ly.is_alive() and gate.reached == 1
        free = ctl.device.allocator(FULL).free_count
        released_at = time.monotonic()
        ctl.release("y", my.lock_id, None)
        ly.join(5)
        assert not ly.is_alive()
        assert isinstance(ly.error, NotFound), ly.error
        assert ly.ended_at - released_at < 1.0  # (not the whole LOAD_WAIT_S)
        assert ctl.device.allocator(FULL).free_count == free  # y reserved nothing
        assert loads_running(ctl) == 1
        gate.open()
        final = lx.result()[-1]
    finally:
        gate.restore()
    eng.verify(final.device_pages, a, 4)
    assert loads_running(ctl) == 0
    ctl.check_integrity()
    ctl.release("x", mx.lock_id, None)


def test_a_waiting_load_copies_itself_when_the_load_it_waited_for_fails(make) -> None:
    ctl, eng, a, mx, my = _two_locks_on_one_l2_path(make)
    gate = CopyGate(ctl)
    gate.fail = True  # the first copy (x's) fails
    try:
        lx = gate.held_load("x", mx.lock_id)
        ly = Loader(ctl, "y", my.lock_id)
        ly.start()
        time.sleep(0.2)
        assert gate.reached == 1
        gate.open()
        with pytest.raises(OSError, match="injected"):
            lx.result()
        final = ly.result()[-1]
    finally:
        gate.restore()
    assert final.device_tokens == 16
    eng.verify(final.device_pages, a, 4)
    assert loads_running(ctl) == 0
    with ctl._mu:
        assert ctl.tree.resident_pages(Tier.DEVICE, FULL) == 4
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total - 4
    ctl.check_integrity()
    ctl.release("x", mx.lock_id, None)
    ctl.release("y", my.lock_id, None)


def test_a_load_waits_at_most_load_wait_s_then_copies_and_one_copy_stays(make, monkeypatch) -> None:
    monkeypatch.setattr(loads_mod, "LOAD_WAIT_S", 0.3)
    ctl, eng, a, mx, my = _two_locks_on_one_l2_path(make)
    gate = CopyGate(ctl)
    try:
        lx = gate.held_load("x", mx.lock_id)
        ly = Loader(ctl, "y", my.lock_id)
        ly.start()
        gate.wait_reached(2)  # after 0.3 s y copies on its own
        assert loads_running(ctl) == 2
        with ctl._mu:
            assert sum(len(d) for d in ctl.loads.loading_pages(FULL)) == 8
        (dev,) = [p for p in ctl.stats().pools if p.tier == "device"]
        assert dev.locked_pages == dev.used_pages == 8
        gate.open()
        fx, fy = lx.result()[-1], ly.result()[-1]
    finally:
        gate.restore()
    np.testing.assert_array_equal(fx.device_pages["full"], fy.device_pages["full"])
    eng.verify(fy.device_pages, a, 4)
    assert loads_running(ctl) == 0
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total - 4
    ctl.check_integrity()
    ctl.release("x", mx.lock_id, None)
    ctl.release("y", my.lock_id, None)


@pytest.mark.parametrize("how", ["no-moves", "abandoned", "lock-released", "copy-fails",
                                 "closed-before-start"])
def test_no_load_stays_registered(make, how: str) -> None:
    from engine_sim import Engine

    ctl = make(write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(4, base=700)
    eng.request(a)
    if how != "no-moves":
        evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", a, lock=True))
    stream = ctl.load("e1", m.lock_id)
    gate = CopyGate(ctl)
    gate.fail = how == "copy-fails"
    try:
        if how == "no-moves":
            gate.open()
            assert len(list(stream)) == 1
        elif how == "closed-before-start":
            stream.close()  # (never started: plan_load never ran)
        elif how == "abandoned":
            first = threading.Thread(target=lambda: next(stream, None), daemon=True)
            first.start()
            gate.wait_reached(1)
            assert loads_running(ctl) == 1
            gate.open()
            first.join(10)
            assert not first.is_alive()
            stream.close()
        else:
            loader = gate.held_load("e1", m.lock_id)
            assert loads_running(ctl) == 1
            if how == "lock-released":
                ctl.release("e1", m.lock_id, None)
            gate.open()
            with pytest.raises(NotFound if how == "lock-released" else OSError):
                loader.result()
    finally:
        gate.restore()
    assert eventually(lambda: loads_running(ctl) == 0, 5)
    ctl.check_integrity()
    if how != "lock-released":
        ctl.release("e1", m.lock_id, None)
    # L1 is whole again: everything not in the tree is free.
    with ctl._mu:
        resident = ctl.tree.resident_pages(Tier.DEVICE, FULL)
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total - resident


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize("url", [
    "redis://cache:6379/0?client_name=svc@node1&password=hunter2",
    "http://meta:8080/metadata?owner=a@b&password=hunter2",
])
def test_redact_url_hides_a_password_after_an_at_in_the_query(url: str) -> None:
    shown = redact_url(url)
    assert "hunter2" not in shown, shown


@pytest.mark.parametrize("url", [
    "redis://cache:6379/0?client_name=svc@node1",
    "http://meta:8080/v1/keys@latest",
])
def test_redact_url_without_credentials_keeps_the_host(url: str) -> None:
    shown = redact_url(url)
    assert "***" not in shown and shown.split("://")[1].startswith(url.split("://")[1].split("/")[0])


@pytest.mark.parametrize("url,hidden,kept", [
    ("redis://:pw@h:6379/0", "pw", "h:6379/0"),
    ("redis://u:p?w#x/y@h:6379/0?password=qq&db=1", "qq", "db=1"),
    ("redis://h:6379/0?password=qq", "qq", "h:6379/0"),
    ("redis://h:6379/0", "", "redis://h:6379/0"),
])
def test_redact_url_credentials_and_plain_urls(url: str, hidden: str, kept: str) -> None:
    shown = redact_url(url)
    if hidden:
        assert hidden not in shown
    assert kept in shown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback_listen_on_the_metrics_port_is_a_valid_configuration() -> None:
    port = _free_port()
    # What the daemon does: metrics on 0.0.0.0:port (IPv4), gRPC on [::1]:port (IPv6).
    v4 = socket.socket(socket.AF_INET)
    v6 = socket.socket(socket.AF_INET6)
    try:
        v4.bind(("0.0.0.0", port))
        v4.listen()
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.bind(("::1", port))  # (no error: the two do not collide)
    finally:
        v4.close()
        v6.close()
    load_config(None, overrides=[f'server.listen="[::1]:{port}"', f"metrics.port={port}"], env={})


@pytest.mark.parametrize("sets", [
    ["server.listen=unix:///tmp/hicache-review.sock", "server.probe_listen=127.0.0.1:9400",
     "metrics.port=0"],
    ["server.listen=unix:///tmp/hicache-review.sock", "metrics.port=0"],
    ['server.listen="[::1]:50051"', 'server.probe_listen="[::1]:50052"', "metrics.port=9400"],
    ['server.listen="[::1]:50051"', 'server.probe_listen="127.0.0.1:50051"', "metrics.port=0"],
])
def test_port_rule_accepts_distinct_listeners(sets: list[str]) -> None:
    load_config(None, overrides=sets, env={})


@pytest.mark.parametrize("sets", [
    ['server.listen="[::]:50051"', 'server.probe_listen="127.0.0.1:50051"', "metrics.port=0"],
    ['server.listen="[::1]:50051"', 'server.probe_listen="[::1]:50051"', "metrics.port=0"],
    ["server.listen=127.0.0.1:9400", "metrics.port=9400"],
])
def test_port_rule_refuses_real_collisions(sets: list[str]) -> None:
    with pytest.raises(ConfigError, match="give each listener its own port"):
        load_config(None, overrides=sets, env={})


@pytest.mark.parametrize("text", ["1e3", "123e4567", "2E5"])
def test_a_quoted_float_looking_string_stays_a_string(text: str) -> None:
    cfg = load_config(None, overrides=[f'model.id="{text}"'], env={})
    assert cfg.model.id == text


def test_a_float_looking_token_is_not_echoed(tmp_path) -> None:
    path = tmp_path / "h.yaml"
    path.write_text('server:\n  listen: "127.0.0.1:50051"\n  tokens:\n'
                    "    - token: 98765e43\n      namespaces: [\"a\"]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    assert "98765" not in str(e.value) and "9.8765" not in str(e.value)


# ---------------------------------------------------------------------- more load races


def test_a_split_of_the_path_while_a_load_waits_lands_once_with_the_right_bytes(make) -> None:
    """x copies A (one 4-page node); y waits for it; meanwhile a match of A's first 2
    pages splits the node x copies. x lands through the split (`_span`), y then has
    nothing left to copy: both get A's pages, byte for byte, one copy kept."""
    ctl, eng, a, mx, my = _two_locks_on_one_l2_path(make)
    gate = CopyGate(ctl)
    try:
        lx = gate.held_load("x", mx.lock_id)
        ly = Loader(ctl, "y", my.lock_id)
        ly.start()
        time.sleep(0.1)
        split = ctl.match("e1", MatchRequest("", a[: 2 * 16], lock=True))  # splits A
        assert split.host_tokens == 8
        assert ly.is_alive() and gate.reached == 1
        gate.open()
        fx, fy = lx.result()[-1], ly.result()[-1]
    finally:
        gate.restore()
    assert gate.reached == 1
    assert fx.device_tokens == fy.device_tokens == 16
    np.testing.assert_array_equal(fx.device_pages["full"], fy.device_pages["full"])
    eng.verify(fy.device_pages, a, 4)
    assert ctl.device.allocator(FULL).free_count == ctl.device.allocator(FULL).total - 4
    ctl.check_integrity()
    for e, lock in (("x", mx.lock_id), ("y", my.lock_id), ("e1", split.lock_id)):
        ctl.release(e, lock, None)


def test_hybrid_stats_during_a_load_never_count_more_locked_than_used(make) -> None:
    from engine_sim import Engine

    ctl = make(hybrid=True, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    a = seq(6, base=4000)
    eng.request(a)
    evict_all(ctl, Tier.DEVICE)
    m = ctl.match("e1", MatchRequest("", a, lock=True, allocate_tokens=len(a) // 4 + 8))
    gate = CopyGate(ctl)
    loader = Loader(ctl, "e1", m.lock_id)
    loader.start()
    try:
        gate.wait_reached(1)
        for p in ctl.stats().pools:
            assert p.locked_pages <= p.used_pages <= p.capacity_pages, p
        (mamba,) = [p for p in ctl.stats().pools if p.tier == "device" and p.member == "mamba"]
        assert mamba.locked_pages == mamba.used_pages  # the allocation's slot and the load's
        ctl.check_integrity()
    finally:
        gate.restore()
    final = loader.result()[-1]
    eng.verify(final.device_pages, a, 6)
    for p in ctl.stats().pools:
        assert p.locked_pages <= p.used_pages, p
    ctl.release("e1", m.lock_id, m.allocation_id)
    assert loads_running(ctl) == 0
