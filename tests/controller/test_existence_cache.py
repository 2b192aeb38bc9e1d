"""The L3 existence cache: what it answers without asking the store, and what it lets go."""

from __future__ import annotations

from hicache.controller.workers import ExistenceCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_known_run_counts_leading_present_keys_and_stops_at_an_unknown_one() -> None:
    cache = ExistenceCache()
    ks = keys(6)
    cache.add_present(ks[:3] + ks[4:])
    assert cache.known_run(ks) == (3, False)  # ks[3] unknown: ask the store from there
    assert cache.known_run(ks[4:]) == (2, False)
    assert cache.known_run([]) == (0, False)


def test_a_key_known_absent_stops_the_run_until_its_ttl_ends() -> None:
    clock = Clock()
    cache = ExistenceCache(negative_ttl_s=1.0, clock=clock)
    ks = keys(3)
    cache.add_present(ks[:1])
    cache.add_absent(ks[1])
    assert cache.known_run(ks) == (1, True)  # no need to ask: known absent
    clock.now += 1.5
    assert cache.known_run(ks) == (1, False)  # expired: ask again


def test_present_and_absent_replace_each_other() -> None:
    cache = ExistenceCache(clock=Clock())
    k = keys(1)
    cache.add_absent(k[0])
    cache.add_present(k)
    assert cache.known_run(k) == (1, False)
    cache.add_absent(k[0])
    assert cache.known_run(k) == (0, True)
    cache.forget(k)
    assert cache.known_run(k) == (0, True)  # forget drops present keys only


def test_over_capacity_the_tails_of_the_oldest_runs_go_first() -> None:
    cache = ExistenceCache(capacity=6)
    old, new = keys(4, "old"), keys(4, "new")
    cache.add_present(old)
    cache.add_present(new)
    assert cache.known_run(new) == (4, False)
    # Two of the old run's keys had to go: its tail, so its head still answers.
    assert cache.known_run(old) == (2, False)
    assert cache.known_run(old[2:]) == (0, False)


def test_a_key_seen_again_becomes_recent() -> None:
    cache = ExistenceCache(capacity=4)
    a, b = keys(2, "a"), keys(2, "b")
    cache.add_present(a)
    cache.add_present(b)
    cache.add_present(a)  # used again: b is now the oldest
    cache.add_present(keys(2, "c"))
    assert cache.known_run(a) == (2, False)
    assert cache.known_run(b) == (0, False)


def test_repeated_keys_in_one_call_are_kept_once() -> None:
    cache = ExistenceCache(capacity=3)
    cache.add_present(["x", "y", "x", "y", "z"])
    assert cache.known_run(["x", "y", "z"]) == (3, False)


def test_a_lookup_keeps_the_head_of_its_run_most_recent() -> None:
    cache = ExistenceCache(capacity=6)
    old, new = keys(4, "old"), keys(4, "new")
    cache.add_present(old)
    cache.add_present(keys(2, "mid"))
    assert cache.known_run(old) == (4, False)  # old is the most recent now, head first
    cache.add_present(new)  # room for 4: mid goes, then old's tail
    assert cache.known_run(old) == (2, False)
    assert cache.known_run(keys(2, "mid")) == (0, False)


def test_a_run_grown_from_known_keys_keeps_its_head_most_recent() -> None:
    # A lookup adds the keys it knew with the ones the store confirmed: the known head
    # must not stay behind the new tail (it would be let go first).
    cache = ExistenceCache(capacity=8)
    run = keys(8, "run")
    cache.add_present(run[:4])
    cache.add_present(run)
    cache.add_present(keys(4, "other"))  # room for 4: the run's tail goes
    assert cache.known_run(run) == (4, False)


def test_a_written_run_keeps_its_head_most_recent(make) -> None:  # type: ignore[no-untyped-def]
    # L3 writes record what they stored in one call per batch: per page, the head of the
    # run would be the oldest key and the first to go.
    from engine_sim import seq

    from hicache.controller.base import InsertRequest, MatchRequest
    from hicache.keys import chain_hashes, split_hashes
    from hicache.types import ComponentKind

    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    assert ctl.l3 is not None
    ctl.l3.cache = ExistenceCache(capacity=1 << 10)
    ctl.attach("e1", 0, 1)
    tokens = seq(8)
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, allocate_tokens=len(tokens) // 4))
    ctl.insert("e1", InsertRequest("", tokens, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert ctl.transfers.drain(10)
    ps = ctl.cfg.model.page_size
    flat = chain_hashes(ctl.cfg.model.chain_seed(""), tokens, ps * 4)
    written = ctl.l3.keys("", split_hashes(flat), ctl.cfg.model.family(ComponentKind.FULL))
    order = list(ctl.l3.cache._present)  # (before known_run, which touches them again)
    assert set(written) <= set(order)
    assert order.index(written[0]) > order.index(written[-1])  # the head is the most recent


def test_a_page_read_back_corrupt_is_not_promised_again_at_every_match(make) -> None:  # type: ignore[no-untyped-def]
    """An object another daemon version wrote under our key (not ours to remove) reads as
    corrupt. The store still says present: every match used to promise the page as L3
    tokens and start a prefetch that read the run again and failed at the same page. It is
    known absent for a while instead; a good copy this node writes ends that at once."""
    from engine_sim import Engine, seq, wait_prefetch

    from hicache.controller.base import MatchRequest
    from hicache.types import ComponentKind

    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request_then_only_in_l3(tokens)
    key = ctl.l3.keys("", [eng.hashes(tokens)[2]], ctl.cfg.model.family(ComponentKind.FULL))[0]
    with open(ctl.l3.backend.path_of(key), "r+b") as f:  # a newer header format version
        f.seek(4)
        f.write((2).to_bytes(2, "little"))
    promised, reads = [], []
    for _ in range(3):
        before = ctl.l3.backend.stats().gets
        m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
        if m.prefetch_id:
            wait_prefetch(ctl, m.prefetch_id)
        ctl.release("e1", m.lock_id, None)
        promised.append(m.storage_tokens)
        reads.append(ctl.l3.backend.stats().gets - before)
    ps = ctl.cfg.model.page_size
    # The first match promised all 4 pages and brought pages 0-1; then page 2 is absent.
    assert promised == [4 * ps, 0, 0] and reads[1:] == [0, 0], (promised, reads)
    assert ctl.l3.backend.exists_prefix([key]) == 1  # left in the store: not ours to judge


def test_a_put_that_finds_the_foreign_object_there_keeps_the_page_absent(make) -> None:  # type: ignore[no-untyped-def]
    """The engine recomputes the page and write-through backs it up: the put answers
    PRESENT (the foreign object is still there). That is no good copy: the page stays
    known absent, not promised and re-read at the next match."""
    from engine_sim import Engine, evict_all, seq, wait_prefetch

    from hicache.controller.base import MatchRequest
    from hicache.types import ComponentKind, Tier

    ctl = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
    eng = Engine(ctl)
    tokens = seq(4)
    eng.request_then_only_in_l3(tokens)
    key = ctl.l3.keys("", [eng.hashes(tokens)[2]], ctl.cfg.model.family(ComponentKind.FULL))[0]
    with open(ctl.l3.backend.path_of(key), "r+b") as f:  # a newer header format version
        f.seek(4)
        f.write((2).to_bytes(2, "little"))
    ps = ctl.cfg.model.page_size
    m = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    assert m.prefetch_id and m.storage_tokens == 4 * ps
    wait_prefetch(ctl, m.prefetch_id)
    ctl.release("e1", m.lock_id, None)
    eng.request(tokens)  # recomputed; its backup of page 2 answers PRESENT
    assert ctl.flush(10) >= 0 and ctl.transfers.drain(10)
    evict_all(ctl, Tier.DEVICE, Tier.HOST)
    before = ctl.l3.backend.stats().gets
    again = ctl.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    if again.prefetch_id:
        wait_prefetch(ctl, again.prefetch_id)
    ctl.release("e1", again.lock_id, None)
    assert again.storage_tokens == 2 * ps and ctl.l3.backend.stats().gets - before == 2


def test_a_corrupt_object_the_read_removed_is_not_marked_absent(make) -> None:  # type: ignore[no-untyped-def]
    """Ours and corrupt: removed at the read, so the store answers absent by itself. A mark
    would only hide the good copy another node writes meanwhile (shared L3)."""
    from engine_sim import Engine, evict_all, seq, wait_prefetch

    from hicache.controller.base import MatchRequest
    from hicache.types import ComponentKind, Tier

    through = {"write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}
    a, b = make(**through), make(**through)  # two nodes, one L3 directory
    ea, eb = Engine(a), Engine(b)
    tokens = seq(4)
    ea.request_then_only_in_l3(tokens)
    key = a.l3.keys("", [ea.hashes(tokens)[2]], a.cfg.model.family(ComponentKind.FULL))[0]
    with open(a.l3.backend.path_of(key), "r+b") as f:  # a flipped payload byte
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    m = a.match("e1", MatchRequest("", tokens, lock=True, prefetch=True))
    wait_prefetch(a, m.prefetch_id)
    a.release("e1", m.lock_id, None)
    assert a.l3.backend.stats().corrupt_removed == 1
    eb.request(tokens)  # node B writes a good copy
    assert b.flush(10) >= 0 and b.transfers.drain(10)
    evict_all(a, Tier.DEVICE, Tier.HOST)
    again = a.match("e1", MatchRequest("", tokens))
    assert again.host_tokens + again.storage_tokens == 4 * a.cfg.model.page_size


def test_with_a_present_ttl_a_key_known_present_is_asked_again_once_it_is_that_old() -> None:
    """A store whose objects expire (Redis `ttl_s`): what was known present may be gone."""
    clock = Clock()
    cache = ExistenceCache(clock=clock, present_ttl_s=5.0)
    ks = keys(3)
    cache.add_present(ks[:2])
    clock.now += 3
    cache.add_present(ks[2:])  # known later
    assert cache.known_run(ks) == (3, False)
    clock.now += 2.5  # ks[0], ks[1] 5.5 s old, ks[2] 2.5 s
    assert cache.known_run(ks) == (0, False)
    assert cache.known_run(ks[2:]) == (1, False)
    cache.add_present(ks[:2])  # seen present again: known anew
    assert cache.known_run(ks) == (3, False)


def test_clear_forgets_present_and_absent_keys() -> None:
    cache = ExistenceCache()
    ks = keys(2)
    cache.add_present(ks[:1])
    cache.add_absent(ks[1])
    cache.clear()
    assert cache.known_run(ks) == (0, False)
