"""Limits and sizes at their edges, through a real daemon and the engine client (a review):
`server.max_tokens_per_request` per op and summed over a Batch, gRPC's message limits
(a Batch whose reply passes the daemon's send limit), an allocation of exactly all of L1
and one grown to it, L1 of one page, thousands of handles held by one engine,
`eviction.max_open_sessions` at 1, namespaces and session ids long, non-ASCII and with
control characters, token ids 0 and 2^32-1, prompts of zero tokens and of one page,
`server.lease_ms` at its minimum. Each limit: it holds exactly, the error's code and
message name it, and nothing cached is lost.

Confirmed bugs are strict xfails."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hicache.client import Client, allocate_op, insert_op, match_op, release_op
from hicache.controller.base import AllocationInfo, InsertOutcome, MatchOutcome
from hicache.errors import InvalidArgument, NotFound, ResourceExhausted

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

MakeDaemon = Callable[..., Daemon]
LIMIT = 8192  # server.max_tokens_per_request of daemonkit's TINY config
L1_PAGES = 16  # tiers.l1.tokens=1024 at page 64


@pytest.fixture(scope="module")
def dm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The TINY daemon (L1 16 pages, L2 32, 8192 tokens a request), shared; own token
    ranges per test."""
    d = Daemon(tmp_path_factory.mktemp("limits")).start()
    yield d
    d.close()


def pools(c: Client) -> dict[str, tuple[int, int]]:
    """tier -> (used, locked) pages."""
    return {p.tier: (p.used_pages, p.locked_pages) for p in c.stats().pools}


def settled(c: Client, timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
    """`pools` once write-through copies in flight no longer pin pages (no handles held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = pools(c)
        if all(locked == 0 for _, locked in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def put(c: Client, prompt: bytes, namespace: str = "", session_id: str = "") -> InsertOutcome:
    """A whole request life: MatchPrefix(allocate_tokens) then Insert."""
    m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4, session_id=session_id)
    return c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id,
                    session_id=session_id)


def held(c: Client) -> tuple[int, int]:
    hb = c.heartbeat()
    return hb.locks, hb.allocations


# --------------------------------------------------------------------------- token ids, prompt sizes


def test_token_ids_0_and_u32_max_are_cached_and_told_apart(dm: Daemon) -> None:
    """Token ids 0 and 2^32-1 are ids like any other (no sentinel): prompts made of them
    are cached, matched page by page, and a prompt differing only in its last token
    (0 against 2^32-1) shares every page but the last. The client refuses -1 and 2^32."""
    with dm.client(engine_id="tok-edges", retries=0) as c:
        c.attach(map_pools=False)
        zeros = [0] * (2 * PAGE)
        maxes = [2**32 - 1] * (2 * PAGE)
        assert put(c, tokens_of(zeros)) == InsertOutcome(2 * PAGE, 0)
        assert put(c, tokens_of(maxes)) == InsertOutcome(2 * PAGE, 0)
        assert c.match(zeros).device_tokens == 2 * PAGE  # (the client packs ints itself)
        assert c.match(np.array(maxes, dtype=np.uint64)).device_tokens == 2 * PAGE
        mixed = [*zeros[:-1], 2**32 - 1]
        assert c.match(mixed).device_tokens == PAGE
        assert put(c, tokens_of(mixed)) == InsertOutcome(PAGE, PAGE)
        assert c.match(mixed).device_tokens == c.match(zeros).device_tokens == 2 * PAGE
        for bad in ([-1], [2**32]):
            with pytest.raises(InvalidArgument, match="uint32"):
                c.match(bad * PAGE)
        assert held(c) == (0, 0)


def tokens_of(ids: list[int]) -> bytes:
    return np.array(ids, dtype="<u4").tobytes()


def test_prompts_of_zero_tokens_and_of_exactly_one_page(dm: Daemon) -> None:
    """Zero tokens: a locked match with allocate_tokens=0 makes both handles (0 pages),
    one with allocate_tokens=PAGE gets one page, and an Insert of no tokens consumes both
    and frees the page. One page is inserted and matched whole; one token short of a page
    is never reused (its page is freed at the Insert)."""
    with dm.client(engine_id="sizes", retries=0) as c:
        c.attach(map_pools=False)
        before = settled(c)["device"][0]
        m = c.match(b"", lock=True, allocate_tokens=0)
        assert m.lock_id and m.allocation_id and m.device_tokens == 0
        assert [len(v) for v in m.pages.values()] == [0]
        assert c.insert(b"", lock_id=m.lock_id, allocation_id=m.allocation_id) == InsertOutcome(0, 0)
        m = c.match(b"", lock=True, allocate_tokens=PAGE)
        assert [len(v) for v in m.pages.values()] == [1]
        assert c.insert(b"", lock_id=m.lock_id, allocation_id=m.allocation_id) == InsertOutcome(0, 0)
        assert held(c) == (0, 0)
        assert settled(c)["device"][0] == before
        one = tokens(PAGE, start=30_000_000)
        assert put(c, one) == InsertOutcome(PAGE, 0)
        assert c.match(one).device_tokens == PAGE
        short = tokens(PAGE - 1, start=31_000_000)
        assert put(c, short) == InsertOutcome(0, 0)
        assert c.match(short).device_tokens == 0
        assert c.match(one).device_tokens == PAGE
        assert settled(c)["device"][0] == before + 1
        assert held(c) == (0, 0)


# --------------------------------------------------------------------------- max_tokens_per_request


def test_batch_ops_each_meet_the_token_limit_alone_and_the_summed_request_its_size(
        dm: Daemon) -> None:
    """In a Batch, each op is held to `max_tokens_per_request` alone: ops at the limit
    succeed, one token (or page) over fails alone, INVALID_ARGUMENT naming the limit. A
    Batch whose ops together pass the request size (4 bytes a token + 1 MiB) is refused
    whole, RESOURCE_EXHAUSTED, and none of its ops takes effect (its Insert commits
    nothing, its Release frees nothing)."""
    with dm.client(engine_id="batch-limit", retries=0) as c:
        c.attach(map_pools=False)
        at = tokens(LIMIT, start=40_000_000)
        over = tokens(LIMIT + 1, start=40_000_000)
        r = c.batch([
            match_op(at),
            match_op(over),
            insert_op(over),
            allocate_op(LIMIT + 1),
            match_op(at[: 4 * PAGE], allocate_tokens=LIMIT + 1),
            match_op(at, lock=True),
        ])
        assert isinstance(r[0], MatchOutcome) and r[0].device_tokens == 0
        for i in (1, 2, 3, 4):
            assert isinstance(r[i], InvalidArgument), (i, r[i])
            assert "max_tokens_per_request" in str(r[i]) and str(LIMIT) in str(r[i]), r[i]
        assert isinstance(r[5], MatchOutcome) and r[5].lock_id
        c.release(lock_id=r[5].lock_id)

        prompt = tokens(2 * PAGE, start=41_000_000)
        m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
        with pytest.raises(ResourceExhausted, match="larger than max"):
            c.batch([
                insert_op(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id),
                match_op(at),
                match_op(at),  # 2 x 32 KiB of tokens with 1 MiB of namespace: over
                match_op(b"", "n" * (1 << 20)),
                release_op(lock_id=m.lock_id),
            ])
        assert held(c) == (1, 1)  # nothing ran
        assert c.match(prompt).device_tokens == 0
        assert c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id) == InsertOutcome(
            2 * PAGE, 0)
        assert c.match(prompt).device_tokens == 2 * PAGE
        assert held(c) == (0, 0)


def test_a_namespace_of_1024_characters_works_and_a_longer_one_is_refused(
        dm: Daemon) -> None:
    """A namespace is at most 1,024 characters (the daemon keeps it as long as its root
    lasts; it used to take anything up to the request size): one at the limit is served
    and its pages match in that namespace only; one longer is INVALID_ARGUMENT naming the
    field, and past the request size RESOURCE_EXHAUSTED; what was cached stays."""
    with dm.client(engine_id="long-ns", retries=0) as c:
        c.attach(map_pools=False)
        ns = "N" * 1024
        prompt = tokens(2 * PAGE, start=42_000_000)
        assert put(c, prompt, ns) == InsertOutcome(2 * PAGE, 0)
        assert c.match(tokens(LIMIT, start=42_000_000), ns).device_tokens == 2 * PAGE
        assert c.match(prompt, ns[:-1]).device_tokens == 0
        assert c.match(prompt).device_tokens == 0
        with pytest.raises(InvalidArgument, match="namespace: 1025 characters; at most 1024"):
            c.match(prompt, ns + "N")
        with pytest.raises(ResourceExhausted, match="larger than max"):
            c.match(tokens(LIMIT, start=42_000_000), ns * 1100)
        assert c.match(prompt, ns).device_tokens == 2 * PAGE
        assert held(c) == (0, 0)


def test_max_tokens_per_request_below_one_page_is_refused(make_daemon: MakeDaemon) -> None:
    check = run_cli("config", "check", "--set", "server.max_tokens_per_request=63",
                    "--set", "tiers.l2.reserve_gb=0")
    if check.returncode == 2:
        assert "server.max_tokens_per_request" in check.stderr + check.stdout
        return
    # Accepted: show what a daemon so configured does with the longest request it takes.
    d = make_daemon("server.max_tokens_per_request=63")
    with d.client(engine_id="tiny-limit", retries=0) as c:
        c.attach(map_pools=False)
        prompt = tokens(63, start=43_000_000)
        outcome = put(c, prompt)
        assert outcome.inserted_tokens > 0, (
            f"config check accepted it (exit {check.returncode}), and the longest request "
            f"the daemon takes caches nothing: {outcome}")


# --------------------------------------------------------------------------- gRPC message sizes


def test_a_batch_whose_reply_passes_the_send_limit_reports_what_it_did(
        make_daemon: MakeDaemon) -> None:
    limit = 4096  # send limit max(4 x 4096, 8 x 4096) + 1 MiB = 1,081,344 bytes
    d = make_daemon("model.page_size=1", "prefetch.threshold_tokens=1",
                    "model.components={full: {layers: 1, bytes_per_token_per_layer: 1}}",
                    "tiers.l1.tokens=16384", f"server.max_tokens_per_request={limit}")
    with d.client(engine_id="grower", retries=0) as c:
        c.attach(map_pools=False)
        a = c.allocate(limit - 100)
        before = pools(c)["device"][0]  # (no inserts here: nothing in flight)
        # 100 growths of one page each, each answering every page held (~4,000 ids):
        # ~1.6 MB of reply from a request of ~2 KB.
        ops = [allocate_op(1, allocation_id=a.allocation_id) for _ in range(100)]
        try:
            results = c.batch(ops)
        except ResourceExhausted as e:
            after = pools(c)["device"][0]
            assert after == before, (
                f"the Batch failed ({e}) but its ops ran: the allocation grew from "
                f"{before} to {after} pages the engine never learned of")
        else:
            grown = sum(isinstance(x, AllocationInfo) for x in results)
            assert pools(c)["device"][0] == before + grown
        c.release(allocation_id=a.allocation_id)


# --------------------------------------------------------------------------- L1 at its edges


def test_an_allocation_of_exactly_all_of_l1_and_one_grown_to_it(dm: Daemon) -> None:
    """With L1 full of cached pages, an allocation of exactly all of L1 evicts them (to
    L2, not lost) and succeeds; one page more is RESOURCE_EXHAUSTED naming what holds the
    pool. An allocation grown to exactly L1 succeeds; growing it further, or growing one
    past L1 in one step, fails taking nothing."""
    with dm.client(engine_id="all-l1", retries=0) as c:
        c.attach(map_pools=False)
        prompt = tokens(L1_PAGES * PAGE, start=50_000_000)
        assert put(c, prompt) == InsertOutcome(L1_PAGES * PAGE, 0)
        settled(c)
        a = c.allocate(L1_PAGES * PAGE)
        assert len(a.pages["full"]) == L1_PAGES == len(set(a.pages["full"].tolist()))
        with pytest.raises(ResourceExhausted, match=r"L1 full: 1 pages needed, 0 of 16 free"):
            c.allocate(1)
        c.release(allocation_id=a.allocation_id)
        m = c.match(prompt)
        assert m.device_tokens + m.host_tokens == L1_PAGES * PAGE  # evicted to L2, kept

        a = c.allocate(8 * PAGE)
        g = c.allocate(8 * PAGE, allocation_id=a.allocation_id)
        assert len(g.pages["full"]) == L1_PAGES
        assert np.array_equal(g.pages["full"][:8], a.pages["full"])
        with pytest.raises(ResourceExhausted, match="L1 full"):
            c.allocate(1, allocation_id=a.allocation_id)
        assert pools(c)["device"] == (L1_PAGES, L1_PAGES)
        c.release(allocation_id=a.allocation_id)
        a = c.allocate(8 * PAGE)
        with pytest.raises(ResourceExhausted, match=r"9 pages needed"):
            c.allocate(9 * PAGE, allocation_id=a.allocation_id)
        assert pools(c)["device"][1] == 8  # the failed growth took nothing
        c.release(allocation_id=a.allocation_id)
        assert held(c) == (0, 0)
        m = c.match(prompt, lock=True)
        assert m.device_tokens + m.host_tokens == L1_PAGES * PAGE
        last = list(c.load(m.lock_id))[-1]  # all of L1 again, from L2
        assert last.device_tokens == L1_PAGES * PAGE
        c.release(lock_id=m.lock_id)


def test_an_l1_of_one_page_serves_one_page_requests_and_refuses_two(
        make_daemon: MakeDaemon) -> None:
    """`tiers.l1.tokens` = one page: a one-page request lives and dies normally, a second
    one pushes the first to L2 (kept, loadable back), a two-page one is RESOURCE_EXHAUSTED
    saying the pool has 1 page, and nothing cached is lost by the refusal."""
    d = make_daemon(f"tiers.l1.tokens={PAGE}")
    with d.client(engine_id="one-page", retries=0) as c:
        c.attach(map_pools=False)
        caps = {p.tier: p.capacity_pages for p in c.stats().pools}
        assert caps == {"device": 1, "host": 2}
        p, q = tokens(PAGE, start=1), tokens(PAGE, start=1_000)
        assert put(c, p) == InsertOutcome(PAGE, 0)
        assert put(c, q) == InsertOutcome(PAGE, 0)
        assert c.match(q).device_tokens == PAGE
        m = c.match(p, lock=True)
        assert (m.device_tokens, m.host_tokens) == (0, PAGE)
        assert list(c.load(m.lock_id))[-1].device_tokens == PAGE
        c.release(lock_id=m.lock_id)
        with pytest.raises(ResourceExhausted, match=r"2 pages needed, the pool has 1"):
            c.match(tokens(2 * PAGE, start=5_000), lock=True, allocate_tokens=2 * PAGE)
        assert held(c) == (0, 0)
        for prompt in (p, q):
            m = c.match(prompt)
            assert m.device_tokens + m.host_tokens == PAGE


# --------------------------------------------------------------------------- many handles


def test_thousands_of_handles_held_by_one_engine(dm: Daemon) -> None:
    """No cap on one engine's handles: 6,000 locks and 6,000 allocations (of 0 pages)
    are held, counted by Heartbeat, cost a request round no more than without them (loose
    bound), and all go in Batches of releases; the cached prefix they locked stays."""
    with dm.client(engine_id="hoarder", retries=0, timeout_s=60) as c:
        c.attach(map_pools=False)
        prompt = tokens(PAGE, start=60_000_000)
        put(c, prompt)

        def round_s(n: int = 20) -> float:
            t0 = time.perf_counter()
            for i in range(n):
                put(c, tokens(PAGE, start=61_000_000 + (i % 4) * PAGE))
            return (time.perf_counter() - t0) / n

        base = min(round_s(), round_s())
        made: list[MatchOutcome] = []
        for _ in range(3):
            made += c.batch([match_op(prompt, lock=True, allocate_tokens=0)] * 1000
                            + [match_op(b"", lock=True, allocate_tokens=0)] * 1000)
        assert all(isinstance(m, MatchOutcome) and m.lock_id and m.allocation_id for m in made)
        assert held(c) == (6000, 6000)
        loaded = min(round_s(), round_s())
        # (not tight: another worker's burst may land on either measurement)
        assert loaded < 5 * base + 0.05, (base, loaded)
        for part in range(0, len(made), 3000):
            chunk = made[part: part + 3000]
            out = c.batch([release_op(lock_id=m.lock_id) for m in chunk]
                          + [release_op(allocation_id=m.allocation_id) for m in chunk])
            assert all(x is None for x in out)
        assert held(c) == (0, 0)
        assert c.match(prompt).device_tokens == PAGE


# --------------------------------------------------------------------------- sessions, namespaces


def test_max_open_sessions_1_closes_the_older_session_keeps_its_data_and_counts(
        make_daemon: MakeDaemon) -> None:
    """`eviction.max_open_sessions: 1`: opening a second session closes the first (as
    CloseSession would: closing it again answers what that close released), counted in
    `hicache_sessions_closed_for_room_total`; no cached page goes with it."""
    port = free_port()
    d = make_daemon("eviction.max_open_sessions=1", f"metrics.port={port}")
    with d.client(engine_id="one-session", retries=0) as c:
        c.attach(map_pools=False)
        a, b = tokens(2 * PAGE, start=70_000_000), tokens(3 * PAGE, start=71_000_000)
        put(c, a, session_id="A")
        put(c, b, session_id="B")  # closes A
        assert c.close_session("A") == 2  # what the close for room released
        assert c.close_session("B") == 3
        assert c.close_session("A") == 2  # (still a recent close)
        put(c, a, session_id="A")
        put(c, a + tokens(PAGE, start=72_000_000), session_id="A")  # the same session goes on
        assert c.close_session("A") == 3
        assert c.match(a).device_tokens == 2 * PAGE and c.match(b).device_tokens == 3 * PAGE
        metrics = scrape(port)
        line = next(x for x in metrics.splitlines()
                    if x.startswith("hicache_sessions_closed_for_room_total"))
        assert float(line.split()[-1]) == 1.0, line


@pytest.mark.parametrize("name", [
    "a" * 1024,
    "\x00",
    "a\x00b",
    "\x01\n\t\x7f",
    "üñí©ødé-名前-🙂",
    " ",
])
def test_odd_and_long_namespaces_and_session_ids_are_isolated_and_quoted_briefly(
        dm: Daemon, name: str) -> None:
    """Namespaces and session ids are opaque strings of any content, up to 1,024
    characters: each namespace matches only itself (not "", not its prefix), a session of
    that id opens and closes, and an error quoting one stays short (cut to 1 KiB)."""
    salt = sum(map(ord, name[:50])) + len(name)
    prompt = tokens(PAGE, start=80_000_000 + 1_000 * (salt % 5_000))
    with dm.client(engine_id="odd-names", retries=0) as c:
        c.attach(map_pools=False)
        assert put(c, prompt, name, session_id=name) == InsertOutcome(PAGE, 0)
        assert c.match(prompt, name).device_tokens == PAGE
        for other in ("", name[:-1], (name + "\x00")[-1024:]):
            if other != name:
                assert c.match(prompt, other).device_tokens == 0, repr(other[:20])
        assert c.close_session(name) == 1
        with pytest.raises(NotFound) as info:
            c.close_session((name + "-never")[-1024:])
        assert len(str(info.value).encode()) <= 1100
        m = c.match(prompt, name, lock=True)
        with pytest.raises(InvalidArgument) as wrong:
            c.insert(prompt, name + "-other", lock_id=m.lock_id)
        assert "namespace" in str(wrong.value) and len(str(wrong.value).encode()) <= 1100
        c.release(lock_id=m.lock_id)
        assert held(c) == (0, 0)


# --------------------------------------------------------------------------- lease_ms


def test_lease_ms_at_its_minimum_is_refused_or_usable(make_daemon: MakeDaemon) -> None:
    check = run_cli("config", "check", "--set", "server.lease_ms=1", "--set", "tiers.l2.reserve_gb=0")
    if check.returncode == 2:
        assert "server.lease_ms" in check.stderr + check.stdout
        return
    d = make_daemon("server.lease_ms=1")
    failures: list[str] = []
    with d.client(engine_id="short-lease", retries=0) as c:
        c.attach(map_pools=False)
        for i in range(5):
            prompt = tokens(2 * PAGE, start=90_000_000 + i * 1_000)
            try:
                m = c.match(prompt, lock=True, allocate_tokens=2 * PAGE)
                time.sleep(0.01)  # the engine's forward pass
                c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
            except Exception as e:  # (reported below)
                failures.append(f"{type(e).__name__}: {e}")
                c.attach(map_pools=False)
    assert not failures, (
        f"config check accepted lease_ms=1 (exit {check.returncode}); "
        f"{len(failures)} of 5 request lives failed: {failures[0]}")
