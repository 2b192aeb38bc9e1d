"""Review: every write policy combination (L1->L2 x L2->L3) does what the docs say.

README `write.*`: `write_through` backs up at insert, `write_through_selective` once a node
has `selective_threshold` hits (a hit: a match whose path crosses the node), `write_back`
only when evicted from the upper tier. `Admin.Flush` writes everything pending down to L3
and reports the FULL pages it stored; pages the store held already are
`backups_l3_present`, never written (or counted) again. A second node sharing the L3 reads
exactly the bytes the first wrote (the engine simulator checks each page byte for byte).
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from engine_sim import Engine, evict_all, prefetch_back, seq

from hicache.controller.base import MatchRequest
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
POLICIES = ("write_through", "write_through_selective", "write_back")
MATRIX = list(itertools.product(POLICIES, POLICIES))
IDS = [f"{a}-{b}" for a, b in MATRIX]


def _cfg(a: str, b: str, **kw) -> dict:
    return {"write__l1_to_l2": a, "write__l2_to_l3": b, "storage__backend": "file", **kw}


def _where(ctl, tokens: bytes) -> tuple[bool, bool, bool]:
    """(L1, L2, L3) of the FULL slot of every node on `tokens`' path, all of them; walks the
    tree without counting a hit."""
    with ctl._mu:
        tree = ctl.tree
        path = tree._walk(tree._roots.get(""), tokens, len(tokens))
        assert sum(n.npages for n in path) == len(tokens) // 16, "prompt not whole in the tree"
        return tuple(all(tree.is_resident(n, FULL, t) for n in path)  # type: ignore[return-value]
                     for t in (Tier.DEVICE, Tier.HOST, Tier.STORAGE))


def _settle(ctl) -> None:
    assert ctl.transfers.drain(10)


def _stored_objects(ctl) -> tuple[int, int]:
    s = ctl.l3.backend.stats()
    return s.stored, s.present


# ---------------------------------------------------------------- the policy matrix


@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), MATRIX, ids=IDS)
def test_each_policy_pair_backs_a_page_up_exactly_when_the_docs_say(make, l1_to_l2, l2_to_l3) -> None:
    """One 4-page prompt: inserted, matched twice (threshold 2), evicted from L1, then
    from L2. Where it is after each step follows from the two policies alone, and every
    page is stored in L2 and in L3 once (counters and the store agree)."""
    ctl = make(**_cfg(l1_to_l2, l2_to_l3))
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request(tokens)
    _settle(ctl)
    l2_now = l1_to_l2 == "write_through"
    l3_now = l2_now and l2_to_l3 == "write_through"
    assert _where(ctl, tokens) == (True, l2_now, l3_now), "after insert"
    ctl.match("e1", MatchRequest("", tokens))  # hit 1
    _settle(ctl)
    assert _where(ctl, tokens) == (True, l2_now, l3_now), "after one hit"
    ctl.match("e1", MatchRequest("", tokens))  # hit 2: selective goes now
    _settle(ctl)
    l2_now = l1_to_l2 != "write_back"
    l3_now = l2_now and l2_to_l3 != "write_back"
    assert _where(ctl, tokens) == (True, l2_now, l3_now), "after two hits"
    evict_all(ctl, Tier.DEVICE)
    _settle(ctl)
    l3_now = l2_to_l3 != "write_back"  # written back to L2, then down as L2->L3 says
    assert _where(ctl, tokens) == (False, True, l3_now), "after L1 eviction"
    evict_all(ctl, Tier.HOST)
    _settle(ctl)
    m = ctl.match("e1", MatchRequest("", tokens))
    assert m.storage_tokens == 16, "a written-back page was lost"
    c = ctl.stats().counters
    assert (c["backups_l2"], c["backups_l3"], c["backups_l3_present"], c["backups_dropped"]) == (4, 4, 0, 0)
    assert _stored_objects(ctl) == (4, 0)  # each object stored once, none offered twice
    # back from L3, byte for byte, and nothing written again afterwards
    prefetch_back(ctl, tokens)
    eng.request(tokens)
    ctl.flush(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    _settle(ctl)
    c = ctl.stats().counters
    assert (c["backups_l3"], c["backups_l3_present"]) == (4, 0)
    assert _stored_objects(ctl) == (4, 0)


@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), MATRIX, ids=IDS)
def test_flush_writes_everything_and_reports_what_it_stored(make, l1_to_l2, l2_to_l3) -> None:
    """Flush writes every page any tier above L3 holds (selective nodes below threshold
    and write-back data included) and returns the FULL pages it stored; a second flush
    stores and reports nothing. A second node on the same L3 reads every page back, byte
    for byte, and finds it present when it backs the same prompts up."""
    ctl = make(**_cfg(l1_to_l2, l2_to_l3))
    eng = Engine(ctl)
    cold, hot = seq(3, 1000), seq(5, 2000)
    eng.request(cold)
    for _ in range(3):
        eng.request(hot)
    _settle(ctl)
    before = ctl.stats().counters["backups_l3"]
    pending = ctl.unflushed_pages()
    assert pending == 8 - before
    assert ctl.flush(10) == pending
    assert ctl.unflushed_pages() == 0
    assert ctl.flush(10) == 0
    assert ctl.stats().counters["backups_l3"] == 8
    assert _stored_objects(ctl) == (8, 0)

    other = make(**_cfg(l1_to_l2, l2_to_l3))
    reader = Engine(other)
    for tokens in (cold, hot):
        m = prefetch_back(other, tokens)
        assert m.storage_tokens == len(tokens) // 4
        got = reader.request(tokens)  # (a prefetch follows into free L1) verifies every page
        assert got.device_tokens + got.host_tokens == len(tokens) // 4
    assert other.flush(10) == 0
    c = other.stats().counters
    assert c["backups_l3"] == 0


@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), MATRIX, ids=IDS)
def test_hybrid_windows_and_checkpoints_go_down_with_their_full_pages(make, l1_to_l2, l2_to_l3) -> None:
    """FULL+SWA+MAMBA (with sidecars): whatever the policies, after a flush a second node
    on the same L3 can resume at the prompt's end: its window and checkpoint were written
    with the FULL pages, and every byte read back is what was written."""
    ctl = make(hybrid=True, **_cfg(l1_to_l2, l2_to_l3))
    eng = Engine(ctl)
    tokens = seq(6, 500)
    eng.request(tokens)
    eng.request(tokens)
    _settle(ctl)
    ctl.flush(10)
    assert ctl.unflushed_pages() == 0
    other = make(hybrid=True, **_cfg(l1_to_l2, l2_to_l3))
    reader = Engine(other)
    m = prefetch_back(other, tokens)
    assert m.storage_tokens == 24
    got = reader.request(tokens)
    assert got.device_tokens + got.host_tokens == 24
    assert reader.checked > 0


# ---------------------------------------------------------------- write-back never loses


def _lost(ctl, prompts: list[bytes]) -> list[int]:
    out = []
    for i, tokens in enumerate(prompts):
        m = ctl.match("e1", MatchRequest("", tokens))
        if m.device_tokens + m.host_tokens + m.storage_tokens != len(tokens) // 4:
            out.append(i)
    return out


@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), [
    ("write_through", "write_through"), ("write_through", "write_through_selective"),
    ("write_through", "write_back"), ("write_through_selective", "write_through"),
    ("write_through_selective", "write_through_selective"), ("write_back", "write_through"),
    ("write_back", "write_through_selective"),
])
def test_with_an_idle_l3_of_room_no_hot_page_is_lost(make, l1_to_l2, l2_to_l3) -> None:
    """L1 of 16 pages, L2 of 32, an unbounded L3 that has finished every write before
    each request: twenty 4-page prompts, each requested three times (hot under any
    threshold), all still in some tier after a flush, nothing counted dropped."""
    ctl = make(l1_tokens=64, **_cfg(l1_to_l2, l2_to_l3))
    eng = Engine(ctl)
    prompts = [seq(4, 1000 * (k + 1)) for k in range(20)]
    for tokens in prompts:
        for _ in range(3):
            eng.request(tokens)
            _settle(ctl)
    ctl.flush(10)
    assert _lost(ctl, prompts) == []
    assert ctl.stats().counters["backups_dropped"] == 0


@pytest.mark.parametrize("l1_to_l2", ["write_back", "write_through_selective"])
def test_a_write_back_l2_never_loses_an_l1_victim_while_l3_is_idle_with_room(make, l1_to_l2) -> None:
    """The same workload as above with l2_to_l3=write_back: L1 evictions write back to L2
    (write_back) or the hot nodes were due a copy there (selective, three hits); once L2 is
    full, making room in it writes its victims to L3, which has room and is idle (every
    write landed before each request). Nothing may be lost."""
    ctl = make(l1_tokens=64, **_cfg(l1_to_l2, "write_back"))
    eng = Engine(ctl)
    prompts = [seq(4, 1000 * (k + 1)) for k in range(20)]
    for tokens in prompts:
        for _ in range(3):
            eng.request(tokens)
            _settle(ctl)
    ctl.flush(10)
    lost = _lost(ctl, prompts)
    dropped = ctl.stats().counters["backups_dropped"]
    assert (lost, dropped) == ([], 0), f"prompts {lost} in no tier, {dropped} pages counted dropped"


# ---------------------------------------------------------------- hybrid, without a flush


@pytest.mark.parametrize(("l1_to_l2", "l2_to_l3"), MATRIX, ids=IDS)
def test_hybrid_a_node_that_reached_l3_by_policy_is_resumable_from_it(make, l1_to_l2, l2_to_l3) -> None:
    """FULL+SWA+MAMBA, no flush: the prompt goes down tier by tier as the policies say
    (three requests: hot; L1 emptied when L1->L2 is write_back; L2 emptied when L2->L3
    is). A second node on the same L3 then resumes at the prompt's end (window and
    checkpoint written with the FULL pages) and every byte it reads back is right."""
    ctl = make(hybrid=True, **_cfg(l1_to_l2, l2_to_l3))
    eng = Engine(ctl)
    tokens = seq(6, 700)
    for _ in range(3):
        eng.request(tokens)
    _settle(ctl)
    if l1_to_l2 == "write_back":
        evict_all(ctl, Tier.DEVICE)
    if l2_to_l3 == "write_back":
        evict_all(ctl, Tier.DEVICE, Tier.HOST)
    _settle(ctl)
    other = make(hybrid=True, **_cfg(l1_to_l2, l2_to_l3))
    reader = Engine(other)
    m = prefetch_back(other, tokens)
    assert m.storage_tokens == 24
    got = reader.request(tokens)
    assert got.device_tokens + got.host_tokens == 24
    c = ctl.stats().counters
    assert (c["backups_l3"], c["backups_l3_present"], c["backups_dropped"]) == (6, 0, 0)


# ---------------------------------------------------------------- a second node, same L3


@pytest.mark.parametrize("l2_to_l3", POLICIES)
def test_a_second_node_computing_the_same_prompt_stores_nothing_and_counts_it_present(
        make, l2_to_l3) -> None:
    """Node A flushed a prompt. Node B computes it itself (no prefetch) and flushes:
    every page is `backups_l3_present`, B's Flush reports 0 pages written, no object is
    stored twice."""
    a = make(**_cfg("write_through", l2_to_l3))
    Engine(a).request(seq(5, 3000))
    a.flush(10)
    assert a.stats().counters["backups_l3"] == 5
    b = make(**_cfg("write_through", l2_to_l3))
    eng = Engine(b, "e2")
    for _ in range(3):  # hot for selective
        eng.request(seq(5, 3000))
    _settle(b)
    assert b.flush(10) == 0
    c = b.stats().counters
    assert (c["backups_l3"], c["backups_l3_present"]) == (0, 5)
    assert _stored_objects(b) == (0, 5)
    assert b.unflushed_pages() == 0


# ---------------------------------------------------------------- what a hit is


def test_selective_counts_a_hit_for_every_node_a_match_crosses_and_none_for_a_load(make) -> None:
    """selective/selective, threshold 2: a prompt's prefix node is hot once two longer
    prompts matched through it (a prefix hit counts); a plain lookup counts; a Load of
    a locked match adds nothing; the longer tails, matched once, stay in L1 alone."""
    ctl = make(**_cfg("write_through_selective", "write_through_selective"))
    eng = Engine(ctl)
    head = seq(2, 4000)
    eng.request(head)  # the head node: 0 hits
    eng.request(head + seq(2, 5000))  # crosses the head: 1 hit
    _settle(ctl)
    assert _where(ctl, head) == (True, False, False)
    ctl.match("e1", MatchRequest("", head + seq(2, 6000)))  # a lookup through it: 2 hits
    _settle(ctl)
    assert _where(ctl, head) == (True, True, True)
    with ctl._mu:
        tail = ctl.tree._walk(ctl.tree._roots[""], head + seq(2, 5000), 64)[-1]
        assert ctl.tree.hits(tail) == 0  # the lookup went another way after the head
        assert not ctl.tree.is_resident(tail, FULL, Tier.HOST)
    m = ctl.match("e1", MatchRequest("", head + seq(2, 5000), lock=True))  # tail: 1 hit
    list(ctl.load("e1", m.lock_id))
    ctl.release("e1", m.lock_id, None)
    _settle(ctl)
    with ctl._mu:
        assert ctl.tree.hits(tail) == 1
        assert not ctl.tree.is_resident(tail, FULL, Tier.HOST)
    c = ctl.stats().counters
    assert (c["backups_l2"], c["backups_l3"]) == (2, 2)


def test_a_flush_past_its_timeout_reports_only_what_landed_and_the_rest_lands_later(make) -> None:
    """write_back/write_back with the store stalled: Flush(0.3 s) returns within about its
    timeout and reports 0 pages written (none landed); once the store answers, the
    queued writes land, are counted, and a later Flush has nothing left to write."""
    ctl = make(**_cfg("write_back", "write_back"))
    Engine(ctl).request(seq(4, 9000))
    gate = threading.Event()
    real = ctl.l3.backend._write_from

    def stalled(keys, buffers):
        assert gate.wait(10)
        return real(keys, buffers)

    ctl.l3.backend._write_from = stalled
    t0 = time.monotonic()
    written = ctl.flush(0.3)
    took = time.monotonic() - t0
    assert written == 0 and took < 2.0
    gate.set()
    _settle(ctl)
    assert ctl.stats().counters["backups_l3"] == 4
    assert ctl.unflushed_pages() == 0
    assert ctl.flush(5) == 0
    assert _stored_objects(ctl) == (4, 0)


# ---------------------------------------------------------------- a real daemon


def test_daemon_admin_flush_writes_cold_selective_pages_and_sigterm_has_nothing_left(tmp_path) -> None:
    """`hicache serve` with selective/selective: a prompt inserted once (below the
    threshold) is only in L1. Admin.Flush writes it (pages_written 5, Stats'
    backups_storage 5), a second Flush writes nothing, SIGTERM's flush then has nothing
    left ("flushed 0 pages"), and a new daemon on the same directory reads back exactly
    the bytes written (KvOracle)."""
    import signal

    from daemon.daemonkit import PAGE, Daemon, tokens

    from hicache.bench.oracle import KvOracle
    from hicache.controller.base import PrefetchState

    store = tmp_path / "l3"
    sets = ("write.l1_to_l2=write_through_selective", "write.l2_to_l3=write_through_selective",
            "storage.backend=file", f"storage.file.path={store}", "prefetch.policy=wait_complete")
    prompt = tokens(5 * PAGE, start=90_000)
    made: list[Daemon] = []
    try:
        d = Daemon(tmp_path, *sets).start()
        made.append(d)
        with d.client() as c:
            att = c.attach()
            oracle = KvOracle(att.info, att.pools)
            m = c.match(prompt, lock=True, allocate_tokens=5 * PAGE)
            oracle.write(prompt, m.pages, start_page=0)
            c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
            assert c.stats().counters["backups_storage"] == 0
            assert c.flush(10) == 5
            assert c.stats().counters["backups_storage"] == 5
            assert c.flush(10) == 0
        assert d.stop(signal.SIGTERM) == 0
        assert "flushed 0 pages" in d.log(), d.log()

        after = Daemon(tmp_path, *sets, listen=f"unix://{tmp_path}/after.sock").start()
        made.append(after)
        with after.client() as c:
            att = c.attach()
            oracle = KvOracle(att.info, att.pools)
            with c.matched(prompt, prefetch=True) as m:
                assert m.storage_tokens == 5 * PAGE
                deadline = time.monotonic() + 15
                while (c.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
                assert c.prefetch_status(m.prefetch_id).state is PrefetchState.DONE
            with c.matched(prompt) as hit:
                last = list(c.load(hit.lock_id))[-1]
                assert last.device_tokens == 5 * PAGE
                oracle.verify(prompt, last.device_pages, 5)
            assert oracle.wrong_bytes == 0 and oracle.pages_checked > 0
            assert c.flush(10) == 0
            assert c.stats().counters["backups_storage"] == 0
    finally:
        for daemon in made:
            daemon.close()


def test_a_write_back_l1_victim_without_l2_room_is_counted_dropped_in_pages(make) -> None:
    """write_back L1->L2, no L3: L2 (32 pages) is full of pages held by locks, so L1's
    write-back victims find no room and are lost: each lost FULL page must be counted
    as dropped, as L2->L3 write-back counts what it cannot write."""
    ctl = make(l1_tokens=64, **_cfg("write_back", "write_through", storage__backend="none"))
    eng = Engine(ctl)
    held = [seq(4, 1000 * (k + 1)) for k in range(8)]
    for tokens in held:
        eng.request(tokens)
    evict_all(ctl, Tier.DEVICE)
    locks = [ctl.match("e1", MatchRequest("", t, lock=True)).lock_id for t in held]
    assert ctl.tree.resident_pages(Tier.HOST, FULL) == 32
    extra = [seq(4, 50_000 + 1000 * k) for k in range(6)]
    for tokens in extra:
        eng.request(tokens)
    _settle(ctl)
    lost = _lost(ctl, extra)
    for lock_id in locks:
        ctl.release("e1", lock_id, None)
    assert lost, "the scene did not lose anything: no room was short"
    assert ctl.stats().counters["backups_dropped"] == 4 * len(lost)
