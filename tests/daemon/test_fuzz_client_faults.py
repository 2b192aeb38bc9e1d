"""A seeded fuzz of whole engine request lives through the real `hicache.client.Client`
against a real daemon, with faults injected between and during calls.

Each step runs one piece of an engine's work, picked at random: a request life (match with
an allocation, KV written into the mapped L1 pool, insert; through `matched()` or unary
calls; mid-request inserts with `keep_lock`, decode growth), requests left open across
steps and finished or abandoned later, a Batch of mixed ops, a standalone allocation, a
read-back of acknowledged data (prefetch from L3, load from L2, match in L1), prefetch
status and cancel, close_session, Stats, Health. Before a step a fault may be armed:
`FaultProxy` (faultproxy.py, between the client and the daemon's TCP port) cuts the connection at the
client's next request (never reaches the daemon) or at the daemon's next answer (a lost
answer), breaks a response stream midway, holds answers past the caller's deadline, or
refuses connections for a while; or the client's deadline is tiny; or the daemon is
stopped (SIGTERM or SIGKILL) while the step's calls run, and started again after it.
Now and then the engine restarts (a new process attaches under its id).

Properties:
- every failure the client raises is a typed `hicache.errors` error with a message, of
  a type the situation allows (never a bare grpc.RpcError, KeyError, ...; never the base
  HicacheError of an unmapped code; never InvalidArgument: the fuzz sends valid requests);
- a call the client sends once is sent once (the stub sees one invocation) and the daemon
  runs it at most that often (its RPC metrics, per daemon process);
- the daemon holds at least the handles the engine knows and at most those plus one per
  handle-making call whose answer never came (Heartbeat's counts): never a duplicated
  allocation or lock (those of a call whose deadline passed, or whose connection closed
  while the daemon ran it, are mostly released at once: counted, `kept after`);
- every L1 page a locked match or a Load reports holds the bytes written for its tokens,
  byte for byte, and data acknowledged by an Insert is found again (in some tier, right
  after it, and at the end: brought back to L1 and read);
- after each fault the client recovers: the next calls succeed once it is gone;
- each call returns within the bound its retries allow (attempts x timeout + backoff);
- at the end, after the client closed and its lease lapsed: nothing locked, no prefetch
  running, the whole L1 allocatable (no leak), and no traceback in the daemon's logs.

Knobs for a longer hunt (the defaults keep the file under ~40 s on 2 cores):
HICACHE_FUZZ_CALLS (steps), HICACHE_FUZZ_SEED, HICACHE_FUZZ_RESTARTS (daemon restarts in
the run, alternating SIGTERM and SIGKILL), HICACHE_FUZZ_LAPSES (connection outages past the
lease), HICACHE_FUZZ_SETS (extra `--set`s for the daemon, `;`-separated, e.g.
`write.l1_to_l2=write_back`), HICACHE_FUZZ_TRACE (a file: every step and call with its
outcome).
The tests after the fuzz reproduce what it found, each fixed: a safe call's retries ended
inside gRPC's reconnect backoff, a failed Load skipped the health check of the next call, a
lock block that raised left the handles its release could not free, a call on a closed
client raised ValueError, a call reaching a stopping daemon failed CANCELLED. (A hunt with
`write.l2_to_l3=write_back` found acknowledged data leaving every tier: its regression test
is in tests/controller/test_write_through.py.)
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hicache.client as client_module
from hicache.client import (
    RETRY_FIRST_S,
    RETRY_GROWTH,
    Client,
    allocate_op,
    close_session_op,
    insert_op,
    match_op,
    release_op,
)
from hicache.controller.base import AllocationInfo, InsertOutcome, MatchOutcome, PrefetchState
from hicache.errors import (
    FailedPrecondition,
    HicacheError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from hicache.pb.hicache.v1 import hicache_pb2 as pb

from .daemonkit import PAGE, Daemon, free_port, scrape
from .faultproxy import FaultProxy

CALLS = int(os.environ.get("HICACHE_FUZZ_CALLS", "150"))
SEED = int(os.environ.get("HICACHE_FUZZ_SEED", "20261203"))
RESTARTS = int(os.environ.get("HICACHE_FUZZ_RESTARTS", "2"))
LAPSES = int(os.environ.get("HICACHE_FUZZ_LAPSES", "0"))
TRACE = os.environ.get("HICACHE_FUZZ_TRACE", "")
EXTRA_SETS = tuple(x for x in os.environ.get("HICACHE_FUZZ_SETS", "").split(";") if x)

LEASE_MS = 1500
TIMEOUT_S = 2.0  # the fuzz client's own deadline
RETRIES = 3
SLACK_S = 2.0  # a call's time bound: what its attempts allow, plus this (a loaded machine)
RECOVER_S = 8.0  # how long the client may take to get through once a fault is gone
UNSAFE_METHODS = ("MatchPrefix", "Allocate", "Insert", "Load")


def daemon_sets(l3: Path, metrics_port: int) -> tuple[str, ...]:
    return (f"server.lease_ms={LEASE_MS}", f"metrics.port={metrics_port}",
            "storage.backend=file", f"storage.file.path={l3}", "write.l2_to_l3=write_through",
            "prefetch.threshold_tokens=64", "prefetch.timeout_base_s=0.5",
            "prefetch.timeout_max_s=2", *EXTRA_SETS)


class Rig:
    """The daemon (on a TCP port; each restart starts another process there, with its own
    metrics port) and the FaultProxy in front of it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.daemons: list[Daemon] = []
        self.start_daemon()
        self.proxy = FaultProxy(self.port)

    @property
    def daemon(self) -> Daemon:
        return self.daemons[-1]

    def start_daemon(self) -> Daemon:
        mport = free_port()
        d = Daemon(self.work, *daemon_sets(self.work / "l3", mport), listen=f"127.0.0.1:{self.port}")
        d.metrics_port = mport  # type: ignore[attr-defined]
        self.daemons.append(d)
        return d.start()

    def close(self) -> None:
        self.proxy.close()
        for d in self.daemons:
            d.close()
            assert d.proc is not None
            for leftover in Path("/dev/shm").glob(f"hicache-*-{d.proc.pid}-*"):
                leftover.unlink(missing_ok=True)


def fresh_tokens(rng: random.Random, n: int) -> bytes:
    return np.array([rng.randrange(1, 1 << 31) for _ in range(n)], dtype="<u4").tobytes()


class Kv:
    """The bytes an engine writes for each page: a function of the tokens up to the page's
    end and of the layer, so a page reused by any request must read the same."""

    def __init__(self) -> None:
        self._rows: dict[tuple[bytes, int, int], np.ndarray] = {}

    def row(self, seq: bytes, page: int, layer: int, width: int) -> np.ndarray:
        key = (hashlib.sha256(seq[: (page + 1) * PAGE * 4]).digest(), layer, width)
        got = self._rows.get(key)
        if got is None:
            if len(self._rows) > 4096:
                self._rows.clear()
            digest = np.frombuffer(hashlib.sha256(key[0] + bytes([layer])).digest(), np.uint8)
            position = (np.arange(width) // 32 % 251).astype(np.uint8)
            got = self._rows[key] = np.tile(digest, -(-width // 32))[:width] + position
        return got

    def write(self, pools: dict[str, Any], seq: bytes, ids: Any, first_page: int) -> None:
        """KV of the whole pages of `seq` from `first_page` on, into `ids` (one per page)."""
        whole = len(seq) // (PAGE * 4)
        for views in pools.values():
            for layer, view in enumerate(views):
                rows = view.numpy()
                for i, pid in enumerate(ids):
                    if first_page + i < whole:
                        rows[int(pid)] = self.row(seq, first_page + i, layer, rows.shape[1])

    def wrong(self, pools: dict[str, Any], seq: bytes, ids: Any, n_pages: int) -> list[int]:
        """Token pages among the first `n_pages` whose bytes (any layer) differ."""
        bad: set[int] = set()
        for views in pools.values():
            for layer, view in enumerate(views):
                rows = view.numpy()
                for page in range(n_pages):
                    if page >= len(ids) or not np.array_equal(
                            rows[int(ids[page])], self.row(seq, page, layer, rows.shape[1])):
                        bad.add(page)
        return sorted(bad)


class CountingStub:
    """The client's HiCache stub, recording each invocation (method, or `Batch!` for a
    Batch holding an op that is not safe to repeat)."""

    def __init__(self, stub: Any, log: Callable[[str], None]) -> None:
        self._stub = stub
        self._log = log

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._stub, name)

        def record(request: Any) -> None:
            if name == "Batch" and any(op.WhichOneof("op") not in client_module._REPEATABLE_OPS
                                       for op in request.ops):
                self._log("Batch!")
            else:
                self._log(name)

        def invoked(request: Any, *args: Any, **kwargs: Any) -> Any:
            record(request)
            return fn(request, *args, **kwargs)

        def future(request: Any, *args: Any, **kwargs: Any) -> Any:  # (calls making handles, TCP)
            record(request)
            return fn.future(request, *args, **kwargs)

        invoked.future = future  # type: ignore[attr-defined]
        return invoked


@dataclass
class Req:
    """A request the engine holds open: its lock, allocation and the sequence so far."""

    seq: bytes
    lock_id: int
    alloc_id: int
    pages: list[int]  # the allocation's page ids, in token order from `start_page`
    start_page: int
    session: str
    clean: int  # the fuzz's fault count when made: a NotFound with no fault since is a bug
    floor: int  # token pages the lock covers: an Insert's tokens start with them


@dataclass
class Acked:
    seq: bytes
    tokens: int  # page-aligned length the Insert acknowledged
    epoch: int


class EngineFault(Exception):
    """What an engine's own code raises inside a `matched()` block."""


class Fuzz:
    """One engine's life through faults: the steps, the bookkeeping and the checks."""

    def __init__(self, rig: Rig, rng: random.Random) -> None:
        self.rig = rig
        self.rng = rng
        self.failures: list[str] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.invoked: list[str] = []  # every stub invocation, in order
        self.kv = Kv()
        self.t0 = time.monotonic()
        self.proxy = self.rig.proxy
        self.epoch = 0
        self.faults = 0  # faults injected so far
        self.fault = ""  # the fault of the step under way ("" none)
        self.restarting = False
        self.sessions = ["s0", "s1", "s2"]
        self.families = [fresh_tokens(self.rng, 12 * PAGE) for _ in range(4)]
        self.acked: list[Acked] = []
        self.reqs: list[Req] = []
        self.held_locks: set[int] = set()
        self.held_allocs: set[int] = set()
        # Handles a call may have made whose answer never came, by why: its answer was lost
        # (the daemon cannot tell: they stay until the engine goes), its deadline passed or
        # its caller went away while the daemon ran it (the daemon releases them).
        self.maybe_locks = {"lost": 0, "deadline": 0, "abandoned": 0}
        self.maybe_allocs = {"lost": 0, "deadline": 0, "abandoned": 0}
        self.prefetches: list[int] = []
        self.need_attach = True
        self.exhausted = False
        self.recoveries: list[float] = []
        self.calls = 0
        self.steps = 0
        self.trace = open(TRACE, "a") if TRACE else None  # noqa: SIM115
        self.epoch_sent: collections.Counter[str] = collections.Counter()
        self.client = self.new_client()
        self.pools: dict[str, Any] = {}

    # ------------------------------------------------------------------ daemon, client

    @property
    def daemon(self) -> Daemon:
        return self.rig.daemons[-1]

    def new_client(self) -> Client:
        c = Client(f"127.0.0.1:{self.proxy.port}", engine_id="fuzz-engine", timeout_s=TIMEOUT_S,
                   retries=RETRIES)
        c._stub = CountingStub(c._stub, self.invoke)  # type: ignore[assignment]
        return c

    def invoke(self, method: str) -> None:
        self.invoked.append(method)
        self.epoch_sent[method] += 1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.proxy.disarm()
        if self.trace:
            self.trace.close()

    def note(self, text: str) -> None:
        if self.trace:
            self.trace.write(text + "\n")
            self.trace.flush()

    def fail(self, what: str, call: str, detail: str) -> None:
        self.failures.append(f"[{what}] step {self.steps} {call} (fault {self.fault or '-'}): {detail}")
        self.note(f"FAILURE {self.failures[-1]}")

    # ------------------------------------------------------------------ one call

    def call(self, what: str, fn: Callable[[], Any], *, unsafe: bool, stream: bool = False,
             recovering: bool = False) -> tuple[bool, Any]:
        """Run one client call and check what it did: (ok, result or error)."""
        timeout = self.client.timeout_s
        backoff_s = RETRY_FIRST_S * (RETRY_GROWTH**RETRIES - 1) / (RETRY_GROWTH - 1)
        repeat_s = (RETRIES + 1) * timeout + backoff_s
        bound = (timeout if stream else repeat_s + timeout if unsafe else repeat_s) + SLACK_S
        mark = len(self.invoked)
        self.calls += 1
        t0 = time.monotonic()
        try:
            value: Any = fn()
            ok = True
        except HicacheError as e:
            value, ok = e, False
        except EngineFault:
            raise
        except Exception as e:  # (a bare grpc.RpcError, KeyError, ...)
            self.fail("untyped", what, f"{type(e).__module__}.{type(e).__qualname__}: {e!r}")
            value, ok = e, False
        elapsed = time.monotonic() - t0
        if elapsed > bound:
            self.fail("slow", what, f"{elapsed:.2f} s, bound {bound:.2f} s (timeout_s {timeout})")
        sent = collections.Counter(self.invoked[mark:])
        for method in (*UNSAFE_METHODS, "Batch!"):
            if sent[method] > 1:
                self.fail("sent twice", what, f"{method} invoked {sent[method]} times")
        outcome = "ok" if ok else type(value).__name__
        self.outcomes[f"{what.split('.')[0]}:{outcome}"] += 1
        self.note(f"  {what}: {outcome} {'' if ok else str(value)[:160]} ({elapsed * 1e3:.1f} ms)")
        if not ok and isinstance(value, HicacheError):
            self.check_error(what, value, recovering)
        return ok, value

    def check_error(self, what: str, e: HicacheError, recovering: bool) -> None:
        message = str(e)
        if not message.strip():
            self.fail("no message", what, repr(e))
        faulty = bool(self.fault or self.restarting or recovering)
        if type(e) is HicacheError and message.startswith("CANCELLED") and self.restarting:
            self.fail("cancelled while stopping", what, f"{message!r} (no typed error for its code)")
        elif type(e) is HicacheError:
            self.fail("generic error", what, f"{message!r} (no typed error for its code)")
        elif isinstance(e, InvalidArgument):
            self.fail("invalid argument", what, message)
        elif isinstance(e, Unavailable):
            if not faulty:
                self.fail("unavailable without a fault", what, message)
        elif isinstance(e, FailedPrecondition):
            if "not attached" in message or "Attach" in message:
                self.need_attach = True
            else:
                self.fail("failed precondition", what, message)
        elif isinstance(e, NotFound):
            if "engine" in message and ("expired" in message or "Attach" in message):
                self.need_attach = True
        elif isinstance(e, ResourceExhausted):
            self.exhausted = True
        else:
            self.fail("unexpected error type", what, f"{type(e).__name__}: {message}")

    # ------------------------------------------------------------------ handles

    def made(self, what: str, unsafe_failed: HicacheError, locks: int, allocs: int) -> None:
        """A handle-making call failed: it may have made its handles anyway."""
        if isinstance(unsafe_failed, Unavailable):
            if self.fault == "cut_sent" and not self.restarting:
                kind = "abandoned"  # its caller went away while the daemon ran it
            elif "no answer in time" in str(unsafe_failed) and not self.proxy_faulty():
                kind = "deadline"  # the daemon saw the deadline pass too
            else:
                kind = "lost"
            self.maybe_locks[kind] += locks
            self.maybe_allocs[kind] += allocs

    def proxy_faulty(self) -> bool:
        return self.fault in ("hold", "down", "cut_answer", "cut_request", "cut_data") or \
            self.restarting

    def hold(self, lock_id: int = 0, alloc_id: int = 0) -> None:
        if lock_id:
            self.held_locks.add(lock_id)
        if alloc_id:
            self.held_allocs.add(alloc_id)

    def drop(self, lock_id: int = 0, alloc_id: int = 0) -> None:
        self.held_locks.discard(lock_id)
        self.held_allocs.discard(alloc_id)

    def uncertain(self, lock_id: int = 0, alloc_id: int = 0) -> int:
        """A call that may or may not have consumed these failed: released now (Release
        is safe to repeat), or they are gone already. Returns how many were still held."""
        held = 0
        for kw in ({"lock_id": lock_id} if lock_id else {}, {"allocation_id": alloc_id} if alloc_id else {}):
            if not kw:
                continue
            ok, r = self.call("uncertain.release", lambda kw=kw: self.client.release(**kw),
                              unsafe=False, recovering=True)
            held += ok
            lock, alloc = kw.get("lock_id", 0), kw.get("allocation_id", 0)
            self.drop(lock, alloc)
            if not ok and not isinstance(r, NotFound):  # not reached: maybe still held
                self.maybe_locks["lost"] += bool(lock)
                self.maybe_allocs["lost"] += bool(alloc)
        return held

    def forget_all(self) -> None:
        """The daemon released everything of this engine (restart, lapse, new process)."""
        self.reqs.clear()
        self.held_locks.clear()
        self.held_allocs.clear()
        for d in (self.maybe_locks, self.maybe_allocs):
            d.update(lost=0, deadline=0, abandoned=0)
        self.prefetches.clear()

    def check_handles(self, where: str) -> None:
        """What the daemon holds for this engine (Heartbeat): at least the handles the
        engine knows, at most those and the ones of calls whose answer never came. (The
        daemon releases what a call made when it sees its caller go: its deadline passed,
        or the connection closed while it ran; not when the reply left before the close
        arrived, which it cannot tell from a reply lost on the way: those stay until the
        engine goes. How many stayed is counted, `kept after`.)"""
        for attempt in range(3):  # (released when the RPC ends, on another thread)
            ok, hb = self.call(f"{where}.heartbeat", self.client.heartbeat, unsafe=False)
            if not ok:
                return
            if attempt == 2 or (hb.locks <= len(self.held_locks) + self.maybe_locks["lost"]
                                and hb.allocations <= len(self.held_allocs) + self.maybe_allocs["lost"]):
                break
            time.sleep(0.1)
        self.note(f"  handles: daemon {hb.locks}/{hb.allocations}, known "
                  f"{len(self.held_locks)}/{len(self.held_allocs)}, maybe {self.maybe_locks}/{self.maybe_allocs}")
        for name, have, known, maybe in (("locks", hb.locks, self.held_locks, self.maybe_locks),
                                         ("allocations", hb.allocations, self.held_allocs,
                                          self.maybe_allocs)):
            lo, hi = len(known), len(known) + sum(maybe.values())
            if have < lo:
                self.fail("handles vanished", where, f"daemon holds {have} {name}, engine knows {lo}")
            elif have > hi:
                self.fail("handles duplicated", where, f"daemon holds {have} {name}, engine knows {lo}, "
                                                       f"and calls that failed may have made {maybe}")
            elif have > lo + maybe["lost"]:
                self.outcomes[f"kept after {'/'.join(k for k, v in maybe.items() if v and k != 'lost')}"] += 1

    # ------------------------------------------------------------------ data

    def check_pages(self, what: str, seq: bytes, pages: Any, n_tokens: int) -> None:
        """Pages a locked match (or a Load) reported: each must hold its tokens' KV."""
        ids = pages.get("full") if pages else None
        n = n_tokens // PAGE
        if n == 0:
            return
        if ids is None or len(ids) < n:
            self.fail("pages missing", what, f"{n} pages reused, {0 if ids is None else len(ids)} listed")
            return
        bad = self.kv.wrong(self.pools, seq, ids, n)
        if bad:
            self.fail("data", what, f"token pages {bad} of {n} (L1 pages {[int(ids[p]) for p in bad]}) "
                                    "do not hold the bytes written for them")

    def ack(self, what: str, seq: bytes, done: InsertOutcome) -> Acked | None:
        whole = len(seq) // (PAGE * 4) * PAGE
        if done.inserted_tokens + done.reused_tokens != whole:
            self.fail("insert outcome", what, f"{done} for {whole} page-aligned tokens")
        if not whole:
            return None
        self.acked.append(Acked(seq, whole, self.epoch))
        return self.acked[-1]

    def load(self, what: str, seq: bytes, lock_id: int) -> None:
        """Load a locked match's L2 part and check the pages the last message lists."""
        ok, steps = self.call(what, lambda: list(self.client.load(lock_id)), unsafe=True, stream=True)
        if not ok:
            return
        if not steps or steps[-1].device_pages is None or steps[-1].device_tokens is None:
            self.fail("load", what, f"no final message with pages: {steps[-1:]}")
            return
        ready = [s.layers_ready for s in steps]
        if ready != sorted(ready) or ready[-1] != steps[-1].layers_total:
            self.fail("load", what, f"layers ready {ready} of {steps[-1].layers_total}")
        self.check_pages(what, seq, steps[-1].device_pages, steps[-1].device_tokens)

    # ------------------------------------------------------------------ actions

    def new_seq(self) -> bytes:
        family = self.rng.choice(self.families)
        head = family[: self.rng.randrange(0, 5) * PAGE * 4]
        tail = self.rng.choice([0, PAGE, 2 * PAGE, PAGE + 17, 5])
        seq = head + fresh_tokens(self.rng, tail)
        return seq if len(seq) >= 4 else fresh_tokens(self.rng, PAGE)

    def match(self, what: str, seq: bytes, **kwargs: Any) -> MatchOutcome | None:
        """A locked match with an allocation for the whole sequence; the KV written."""
        ok, m = self.call(what, lambda: self.client.match(seq, lock=True, allocate_tokens=len(seq) // 4,
                                                          **kwargs), unsafe=True)
        if not ok:
            self.made(what, m, 1, 1)
            return None
        self.took(what, seq, m)
        return m  # type: ignore[no-any-return]

    def took(self, what: str, seq: bytes, m: MatchOutcome) -> None:
        self.hold(m.lock_id, m.allocation_id)
        self.check_pages(what, seq, m.device_pages, m.device_tokens)
        self.kv.write(self.pools, seq, m.pages.get("full", ()), m.device_tokens // PAGE)
        if m.prefetch_id:
            self.prefetches.append(m.prefetch_id)

    def as_req(self, seq: bytes, m: MatchOutcome, session: str) -> Req:
        return Req(seq, m.lock_id, m.allocation_id, [int(p) for p in m.pages.get("full", ())],
                   m.device_tokens // PAGE, session, self.faults,
                   (m.device_tokens + m.host_tokens) // PAGE)

    def gone(self, what: str, e: Any, req: Req) -> None:
        """A call on the request's handles failed: NotFound with no fault since it was made
        is a vanished handle; a failure that may have consumed them leaves them uncertain."""
        if isinstance(e, NotFound) and req.clean == self.faults and not self.need_attach:
            self.fail("handle vanished", what, str(e))
        if isinstance(e, Unavailable):
            self.uncertain(req.lock_id, req.alloc_id)
        elif isinstance(e, NotFound):
            self.drop(req.lock_id, req.alloc_id)

    def act_life_matched(self) -> None:
        seq, session = self.new_seq(), self.rng.choice(["", *self.sessions])
        cm = self.client.matched(seq, allocate_tokens=len(seq) // 4, session_id=session,
                                 prefetch=self.rng.random() < 0.3)
        ok, m = self.call("matched.enter", cm.__enter__, unsafe=True)
        if not ok:
            self.made("matched.enter", m, 1, 1)
            return
        self.took("matched.enter", seq, m)
        if m.host_tokens and self.rng.random() < 0.7:
            self.load("matched.load", seq, m.lock_id)
        if self.rng.random() < 0.15:  # the engine's own code fails inside the block
            err = EngineFault("kernel failed")
            try:  # (False: the `with` statement raises the block's error on)
                if cm.__exit__(EngineFault, err, None):
                    self.fail("body error hidden", "matched.exit", "the block's error was swallowed")
            except BaseException as other:
                self.fail("body error replaced", "matched.exit", f"{type(other).__name__}: {other}")
            if self.uncertain(m.lock_id, m.allocation_id):  # (the block released them)
                self.fail("block left handles", "matched.exit", "a block that raised left its "
                          "lock or allocation held (its release failed; only logged)")
            return
        ok, done = self.call("matched.insert", lambda: self.client.insert(
            seq, lock_id=m.lock_id, allocation_id=m.allocation_id, session_id=session), unsafe=True)
        acked = self.ack("matched.insert", seq, done) if ok else None
        ok, _ = self.call("matched.exit", lambda: cm.__exit__(None, None, None), unsafe=False)
        if ok:
            self.drop(m.lock_id, m.allocation_id)
        else:
            self.uncertain(m.lock_id, m.allocation_id)
        if ok and acked is not None and not self.fault:
            self.read_back("matched.verify", acked, strict=True)

    def act_life_unary(self) -> None:
        seq, session = self.new_seq(), self.rng.choice(["", *self.sessions])
        m = self.match("life.match", seq, session_id=session)
        if m is None:
            return
        req = self.as_req(seq, m, session)
        if m.host_tokens and self.rng.random() < 0.5:
            self.load("life.load", seq, m.lock_id)
        if self.rng.random() < 0.3:
            self.mid_insert(req)
        self.finish(req)

    def act_open(self) -> None:
        if len(self.reqs) >= 2:
            return self.act_finish()
        seq, session = self.new_seq(), self.rng.choice(["", *self.sessions])
        m = self.match("open.match", seq, session_id=session, prefetch=self.rng.random() < 0.3)
        if m is not None:
            self.reqs.append(self.as_req(seq, m, session))

    def act_grow(self) -> None:
        if not self.reqs:
            return self.act_open()
        req = self.rng.choice(self.reqs)
        n = self.rng.choice([1, PAGE, 2 * PAGE])
        ok, a = self.call("grow.allocate", lambda: self.client.allocate(n, allocation_id=req.alloc_id),
                          unsafe=True)
        if not ok:
            if isinstance(a, NotFound):
                self.gone("grow.allocate", a, req)
                self.reqs.remove(req)
            return
        assert isinstance(a, AllocationInfo)
        pages = [int(p) for p in a.pages["full"]]
        if a.allocation_id != req.alloc_id or pages[: len(req.pages)] != req.pages:
            self.fail("grow", "grow.allocate", f"{req.pages} grew into {pages} (id {a.allocation_id})")
        req.pages = pages
        # The engine decodes into the new pages: the sequence grows to fill them.
        want = (req.start_page + len(pages)) * PAGE
        have = len(req.seq) // 4
        if want > have:
            req.seq += fresh_tokens(self.rng, self.rng.randrange(max(1, want - have - PAGE + 1), want - have + 1))
        self.kv.write(self.pools, req.seq, req.pages, req.start_page)

    def mid_insert(self, req: Req) -> None:
        """An Insert after prefill (keep_lock): the request goes on."""
        whole = len(req.seq) // (PAGE * 4)
        if whole < 1:
            return
        if whole < req.floor:
            return
        upto = self.rng.randrange(max(1, req.start_page, req.floor), whole + 1)
        part = req.seq[: upto * PAGE * 4]
        ok, done = self.call("mid.insert", lambda: self.client.insert(
            part, lock_id=req.lock_id, allocation_id=req.alloc_id, session_id=req.session,
            keep_lock=True), unsafe=True)
        if ok:
            self.ack("mid.insert", part, done)
            used = max(0, upto - req.start_page)
            req.pages = req.pages[used:]
            req.start_page = max(req.start_page, upto)
            req.floor = upto
        elif isinstance(done, Unavailable | NotFound):
            self.gone("mid.insert", done, req)
            req.lock_id = req.alloc_id = 0

    def finish(self, req: Req) -> None:
        if req in self.reqs:
            self.reqs.remove(req)
        if not req.lock_id:
            return
        if self.rng.random() < 0.12:  # the request is abandoned
            for kw in ({"lock_id": req.lock_id}, {"allocation_id": req.alloc_id}):
                ok, e = self.call("abandon.release", lambda kw=kw: self.client.release(**kw), unsafe=False)
                if ok:
                    self.drop(**{"lock_id": kw.get("lock_id", 0), "alloc_id": kw.get("allocation_id", 0)})
                else:
                    self.gone("abandon.release", e, req)
            return
        ok, done = self.call("finish.insert", lambda: self.client.insert(
            req.seq, lock_id=req.lock_id, allocation_id=req.alloc_id, session_id=req.session),
            unsafe=True)
        if ok:
            self.drop(req.lock_id, req.alloc_id)
            acked = self.ack("finish.insert", req.seq, done)
            if acked is not None and not self.fault:
                self.read_back("finish.verify", acked, strict=True)
        else:
            self.gone("finish.insert", done, req)

    def act_finish(self) -> None:
        if not self.reqs:
            return self.act_life_unary()
        req = self.rng.choice(self.reqs)
        if self.rng.random() < 0.3:
            self.mid_insert(req)
        self.finish(req)

    def act_batch(self) -> None:
        """A scheduler step: new requests, a finished one, a release, housekeeping."""
        ops: list[pb.BatchOp] = []
        kinds: list[tuple[str, Any]] = []
        for _ in range(self.rng.randrange(0, 3)):
            seq, session = self.new_seq(), self.rng.choice(["", *self.sessions])
            ops.append(match_op(seq, lock=True, allocate_tokens=len(seq) // 4, session_id=session))
            kinds.append(("match", (seq, session)))
        if self.reqs and self.rng.random() < 0.6:
            req = self.reqs.pop(self.rng.randrange(len(self.reqs)))
            ops.append(insert_op(req.seq, lock_id=req.lock_id, allocation_id=req.alloc_id,
                                 session_id=req.session))
            kinds.append(("insert", req))
        if self.reqs and self.rng.random() < 0.3:
            req = self.reqs.pop(self.rng.randrange(len(self.reqs)))
            ops += [release_op(lock_id=req.lock_id), release_op(allocation_id=req.alloc_id)]
            kinds += [("release", req), ("release", None)]
        if self.rng.random() < 0.3:
            ops.append(allocate_op(self.rng.choice([1, PAGE, 2 * PAGE])))
            kinds.append(("allocate", None))
        if self.rng.random() < 0.3:
            ops.append(close_session_op(self.rng.choice(self.sessions)))
            kinds.append(("close_session", None))
        if self.rng.random() < 0.3:
            ops.append(pb.BatchOp(stats=pb.StatsRequest()))
            kinds.append(("stats", None))
        if self.prefetches and self.rng.random() < 0.3:
            ops.append(pb.BatchOp(prefetch_status=pb.PrefetchStatusRequest(
                prefetch_id=self.rng.choice(self.prefetches))))
            kinds.append(("prefetch_status", None))
        if not ops:
            ops.append(pb.BatchOp(stats=pb.StatsRequest()))
            kinds.append(("stats", None))
        unsafe = any(op.WhichOneof("op") not in client_module._REPEATABLE_OPS for op in ops)
        ok, results = self.call("batch", lambda: self.client.batch(ops), unsafe=unsafe)
        if not ok:
            for kind, arg in kinds:
                if kind == "match":
                    self.made("batch", results, 1, 1)
                elif kind == "allocate":
                    self.made("batch", results, 0, 1)
                elif kind in ("insert", "release") and arg is not None:
                    self.gone("batch", results, arg)
            return
        if len(results) != len(ops):
            self.fail("batch", "batch", f"{len(results)} results for {len(ops)} ops")
            return
        for i, ((kind, arg), result) in enumerate(zip(kinds, results, strict=True)):
            what = f"batch.{kind}"
            if isinstance(result, HicacheError):
                if not str(result).startswith(f"op {i} ("):
                    self.fail("batch op message", what, f"{result!r} does not name op {i}")
                self.outcomes[f"{what}:{type(result).__name__}"] += 1
                self.check_error(what, result, False)
                if kind in ("insert", "release") and arg is not None:
                    self.gone(what, result, arg)
                continue
            if kind == "match":
                seq, session = arg
                self.took(what, seq, result)
                self.reqs.append(self.as_req(seq, result, session))
            elif kind == "insert":
                self.drop(arg.lock_id, arg.alloc_id)
                self.ack(what, arg.seq, result)
            elif kind == "release" and arg is not None:
                self.drop(arg.lock_id, arg.alloc_id)
            elif kind == "allocate":
                self.hold(alloc_id=result.allocation_id)
                self.call("batch.free", lambda a=result.allocation_id: self.client.release(allocation_id=a),
                          unsafe=False)
                self.drop(alloc_id=result.allocation_id)
        while len(self.reqs) > 2:  # (room in the 16-page L1)
            self.finish(self.reqs[0])

    def act_allocate(self) -> None:
        """Pages for a sequence nothing matched (no lock): written and inserted, or not."""
        seq = fresh_tokens(self.rng, self.rng.choice([PAGE, 2 * PAGE, 2 * PAGE + 5]))
        use_block = self.rng.random() < 0.5
        if use_block:
            cm = self.client.allocation(len(seq) // 4)
            ok, a = self.call("allocation.enter", cm.__enter__, unsafe=True)
        else:
            ok, a = self.call("allocate", lambda: self.client.allocate(len(seq) // 4), unsafe=True)
        if not ok:
            self.made("allocate", a, 0, 1)
            return
        self.hold(alloc_id=a.allocation_id)
        self.kv.write(self.pools, seq, a.pages["full"], 0)
        if self.rng.random() < 0.7:
            ok, done = self.call("allocate.insert", lambda: self.client.insert(
                seq, allocation_id=a.allocation_id), unsafe=True)
            if ok:
                self.ack("allocate.insert", seq, done)
                self.drop(alloc_id=a.allocation_id)
        if use_block:
            ok, _ = self.call("allocation.exit", lambda: cm.__exit__(None, None, None), unsafe=False)
            if ok:
                self.drop(alloc_id=a.allocation_id)
        if a.allocation_id in self.held_allocs:
            self.uncertain(alloc_id=a.allocation_id)

    def act_read_back(self) -> None:
        if self.acked:
            self.read_back("read_back", self.rng.choice(self.acked[-12:]), strict=False)

    def read_back(self, what: str, acked: Acked, strict: bool) -> None:
        """Find acknowledged data again and read it in L1: `strict` (no fault, no restart
        since it was acknowledged) must find all of it in some tier."""
        seq = acked.seq[: acked.tokens * 4]
        for _ in range(2):
            ok, m = self.call(f"{what}.match", lambda: self.client.match(seq, lock=True, prefetch=True),
                              unsafe=True)
            if not ok:
                self.made(what, m, 1, 0)
                return
            self.hold(m.lock_id)
            found = m.device_tokens + m.host_tokens + m.storage_tokens
            self.note(f"  found {m.device_tokens}/{m.host_tokens}/{m.storage_tokens} of {acked.tokens} "
                      f"(epoch {acked.epoch}, now {self.epoch}), prefetch {m.prefetch_id}")
            if strict and acked.epoch == self.epoch and found < acked.tokens:
                self.fail("acked data lost", what, f"{found} of {acked.tokens} acknowledged tokens found "
                                                   f"({m.device_tokens}/{m.host_tokens}/{m.storage_tokens})")
            self.check_pages(f"{what}.match", seq, m.device_pages, m.device_tokens)
            if m.host_tokens:
                self.load(f"{what}.load", seq, m.lock_id)
            waited = 0
            pid = m.prefetch_id
            if pid:
                self.prefetches.append(pid)
            while pid and waited < 20:
                ok, info = self.call(f"{what}.prefetch_status",
                                     lambda pid=pid: self.client.prefetch_status(pid), unsafe=False)
                if not ok or info.state is not PrefetchState.RUNNING:
                    break
                time.sleep(0.02)
                waited += 1
            if m.lock_id:
                lock_id = m.lock_id
                ok, e = self.call(f"{what}.release", lambda lock_id=lock_id: self.client.release(lock_id=lock_id),
                                  unsafe=False)
                if ok or isinstance(e, NotFound):
                    self.drop(lock_id)
                else:
                    self.uncertain(lock_id)
            if not m.prefetch_id:
                return

    def act_prefetch(self) -> None:
        if not self.prefetches:
            return self.act_read_back()
        pid = self.rng.choice(self.prefetches)
        if self.rng.random() < 0.5:
            ok, info = self.call("prefetch_status", lambda: self.client.prefetch_status(pid), unsafe=False)
            if ok and not (0 <= info.tokens_ready <= info.tokens_total):
                self.fail("prefetch", "prefetch_status", str(info))
        else:
            self.call("cancel_prefetch", lambda: self.client.cancel_prefetch(pid), unsafe=False)

    def act_housekeeping(self) -> None:
        pick = self.rng.random()
        if pick < 0.35:
            self.call("close_session", lambda: self.client.close_session(self.rng.choice(self.sessions)),
                      unsafe=False)
        elif pick < 0.7:
            ok, s = self.call("stats", self.client.stats, unsafe=False)
            if ok and {p.tier for p in s.pools} != {"device", "host"}:
                self.fail("stats", "stats", str(s.pools))
        else:
            self.call("health", lambda: self.client.health(deep=self.rng.random() < 0.3), unsafe=False)

    # ------------------------------------------------------------------ faults

    ACTIONS: tuple[tuple[str, int], ...] = (
        ("act_life_matched", 16), ("act_life_unary", 16), ("act_open", 10), ("act_grow", 6),
        ("act_finish", 10), ("act_batch", 16), ("act_allocate", 7), ("act_read_back", 8),
        ("act_prefetch", 4), ("act_housekeeping", 7),
    )
    FAULTS: tuple[tuple[str, int], ...] = (
        ("", 50), ("cut_request", 7), ("cut_sent", 8), ("cut_answer", 11), ("cut_data", 5), ("deadline", 9),
        ("hold", 5), ("down", 1),
    )

    def pick(self, table: tuple[tuple[str, int], ...]) -> str:
        names, weights = zip(*table, strict=True)
        return self.rng.choices(names, weights)[0]

    def arm(self, fault: str) -> list[threading.Thread]:
        timers: list[threading.Thread] = []
        p, rng = self.proxy, self.rng
        if fault == "cut_request":
            p.cut_requests = 1
        elif fault == "cut_sent":
            p.cut_sent = 1
        elif fault == "cut_answer":
            p.cut_answers = 1
        elif fault == "cut_data":
            p.cut_after_data = rng.randrange(1, 4)
        elif fault == "deadline":
            self.client.timeout_s = rng.choice([0.0002, 0.001, 0.002, 0.004, 0.008, 0.015, 0.03])
        elif fault == "hold":
            p.hold_answers_s = rng.uniform(0.03, 0.15)
            self.client.timeout_s = rng.uniform(0.01, 0.08)
        elif fault in ("down", "lapse"):
            p.go_down()
            back = rng.uniform(0.02, 0.4) if fault == "down" else LEASE_MS / 1e3 * 1.8
            timers.append(threading.Timer(back, lambda: setattr(p, "down", False)))
        elif fault in ("sigterm", "sigkill"):
            self.check_sent_once()
            self.restarting = True
            proc = self.daemon.proc
            assert proc is not None
            sig = signal.SIGTERM if fault == "sigterm" else signal.SIGKILL
            timers.append(threading.Timer(rng.uniform(0.0, 0.03), lambda: os.kill(proc.pid, sig)))
        for t in timers:
            t.start()
        if fault:
            self.faults += 1
        return timers

    def disarm(self, fault: str, timers: list[threading.Thread]) -> None:
        for t in timers:
            t.join()
        self.proxy.disarm()
        self.client.timeout_s = TIMEOUT_S
        if fault in ("sigterm", "sigkill"):
            assert self.daemon.proc is not None
            code = self.daemon.proc.wait(timeout=30)
            if fault == "sigterm" and code != 0:
                self.fail("daemon stop", fault, f"exit code {code}")
            self.rig.start_daemon()
            self.epoch += 1
            self.epoch_sent.clear()
            self.need_attach = True

    def recover(self, fault: str) -> None:
        """Once the fault is gone the client gets through: at once where the daemon stayed
        up, within RECOVER_S where it restarted (gRPC reconnects with a backoff)."""
        t0 = time.monotonic()
        tries = 0
        while True:
            tries += 1
            ok, e = self.call("recover.stats", self.client.stats, unsafe=False, recovering=True)
            if ok:
                break
            if time.monotonic() - t0 > RECOVER_S:
                self.fail("no recovery", "recover.stats", f"{e} for {RECOVER_S} s after the fault")
                return
            time.sleep(0.05)
        took = time.monotonic() - t0
        self.recoveries.append(took)
        if tries > 1:  # (the daemon was reachable again, or ready after its restart)
            kind = "reconnect backoff" if fault in ("sigterm", "sigkill", "down", "lapse") else \
                "slow recovery"
            self.fail(kind, "recover.stats", f"{tries} tries ({took:.2f} s) after {fault}")
        self.restarting = False

    def attach(self) -> None:
        ok, att = self.call("attach", self.client.attach, unsafe=False, recovering=True)
        if ok:
            self.pools = att.pools
            self.forget_all()
            self.need_attach = False

    def engine_restart(self) -> None:
        """A new process of the engine attaches under its id: the daemon releases what its
        predecessor held (the answers it lost included)."""
        self.note("engine restart")
        self.client.close()
        client_module._new_instance_id()
        self.client = self.new_client()
        self.attach()
        if not self.need_attach:
            self.check_handles("restarted")

    def check_sent_once(self) -> None:
        """The daemon ran each call not safe to repeat at most as often as the client sent
        it (its RPC metrics; the client's invocations since this daemon started)."""
        text = scrape(self.daemon.metrics_port)  # type: ignore[attr-defined]
        ran: collections.Counter[str] = collections.Counter()
        for labels, value in re.findall(r"^hicache_rpc_seconds_count\{([^}]*)\} (\S+)$", text, re.M):
            method = re.search(r'method="hicache\.v1\.HiCache/(\w+)"', labels)
            if method:
                ran[method.group(1)] += int(float(value))
        sent = self.epoch_sent
        for method in UNSAFE_METHODS:
            if ran[method] > sent[method]:
                self.fail("applied twice", "metrics", f"{method}: daemon ran {ran[method]}, "
                                                      f"client sent {sent[method]}")
        if ran["Batch"] > sent["Batch"] + sent["Batch!"]:
            self.fail("applied twice", "metrics", f"Batch: daemon ran {ran['Batch']}, client sent "
                                                  f"{sent['Batch'] + sent['Batch!']}")
        self.note(f"  sent once: daemon ran {dict(ran)}, client sent {dict(sent)}")

    # ------------------------------------------------------------------ the run

    def run(self, steps: int) -> None:
        special: dict[int, str] = {}
        for i in range(RESTARTS):
            special[int(steps * (i + 1) / (RESTARTS + 1))] = ("sigterm", "sigkill")[i % 2]
        for i in range(LAPSES):
            special.setdefault(int(steps * (i + 0.5) / max(1, LAPSES)), "lapse")
        for step in range(steps):
            self.steps = step
            self.fault = ""
            if self.client.detached is not None:
                self.need_attach = True
            if self.need_attach:
                self.attach()
                if self.need_attach:
                    self.recover("attach")
                    continue
            fault = special.get(step) or self.pick(self.FAULTS)
            action = self.pick(self.ACTIONS)
            self.note(f"step {step}: {action} fault={fault or '-'} epoch={self.epoch} "
                      f"t={time.monotonic() - self.t0:.2f}")
            timers = self.arm(fault)
            self.fault = fault
            try:
                getattr(self, action)()
            finally:
                self.disarm(fault, timers)
            if fault:
                self.recover(fault)
            maybe = sum(self.maybe_locks.values()) + sum(self.maybe_allocs.values())
            if maybe > 6 or self.exhausted:
                self.engine_restart()
                self.exhausted = False
            if not fault and step % 8 == 0:
                self.check_handles("step")

    def finish_run(self) -> None:
        """Everything open is finished, acknowledged data read back in L1, then the engine
        goes: once its lease lapsed nothing of it stays."""
        self.fault = ""
        self.steps += 1
        self.recover("end")
        if self.client.detached is not None or self.need_attach:
            self.attach()
        for req in list(self.reqs):
            self.finish(req)
        self.check_handles("end")
        # Acknowledged data, newest first: found again (in some tier) unless a SIGKILL
        # came after it (write-through to L3 runs behind), and read in L1.
        for acked in reversed(self.acked[-10:]):
            self.read_back("end.read_back", acked, strict=True)
            self.bring_to_l1(acked)
        self.check_sent_once()
        self.client.close()
        self.final_checks()

    def bring_to_l1(self, acked: Acked) -> None:
        seq = acked.seq[: acked.tokens * 4]
        with self.client.matched(seq) as m:
            found = m.device_tokens
            self.check_pages("end.match", seq, m.device_pages, m.device_tokens)
            if m.host_tokens:
                last = list(self.client.load(m.lock_id))[-1]
                found = last.device_tokens or 0
                self.check_pages("end.load", seq, last.device_pages, found)
        if acked.epoch == self.epoch and found < acked.tokens:
            self.fail("acked data lost", "end", f"{found} of {acked.tokens} tokens brought to L1")

    def final_checks(self) -> None:
        time.sleep(LEASE_MS / 1e3 * 1.5)  # the engine's lease lapses (swept every third)
        with Client(self.daemon.target, engine_id="fuzz-final", timeout_s=10) as c:
            deadline = time.monotonic() + 10
            while True:
                stats = c.stats()
                locked = [(p.tier, p.locked_pages) for p in stats.pools if p.locked_pages]
                running = stats.counters["prefetches_running"]
                if not locked and not running:
                    break
                if time.monotonic() > deadline:
                    self.fail("leak", "end.stats", f"locked {locked}, prefetches running {running} "
                                                   "after the engine's lease lapsed")
                    break
                time.sleep(0.1)
            c.attach(map_pools=False)
            held = c.heartbeat()
            assert (held.locks, held.allocations) == (0, 0)
            capacity = next(p.capacity_pages for p in stats.pools if p.tier == "device")
            try:
                with c.allocation(capacity * PAGE):
                    pass
            except ResourceExhausted as e:
                self.fail("leak", "end.allocate", f"the whole L1 cannot be allocated: {e}; {stats.pools}")
        for d in self.rig.daemons:
            log = d.log()
            for bad in ("Traceback", "failed unexpectedly"):
                if bad in log:
                    at = log.index(bad)
                    self.fail("daemon log", d.log_path.name, log[max(0, at - 300) : at + 1500])


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("fuzz-faults"))
    yield r
    r.close()


@pytest.mark.timeout(300)
def test_fuzz_engine_request_lives_through_faults(rig: Rig) -> None:
    started = time.monotonic()
    fuzz = Fuzz(rig, random.Random(SEED))
    try:
        fuzz.run(CALLS)
        fuzz.finish_run()
    finally:
        fuzz.close()
    took = time.monotonic() - started
    print(f"fuzz: {fuzz.steps} steps, {fuzz.calls} calls, {fuzz.faults} faults, {fuzz.epoch} daemon "
          f"restarts in {took:.1f} s (seed {SEED}); recoveries: max "
          f"{max(fuzz.recoveries, default=0):.2f} s")
    print("fuzz: outcomes:", dict(sorted(fuzz.outcomes.items())))
    failures = fuzz.failures
    distinct: dict[str, str] = {}
    for f in failures:
        distinct.setdefault(re.sub(r"step \d+ ", "", f)[:90], f)
    assert not failures, f"{len(failures)} failures, {len(distinct)} distinct:\n" + "\n".join(distinct.values())


# ----------------------------------------------------------------------------- what the fuzz found


def test_a_safe_call_retried_across_a_brief_outage_gets_through(rig: Rig) -> None:
    """Found by the fuzz (every outage and daemon restart): the connection fails once, gRPC
    waits its reconnect backoff before trying again and fails every call meanwhile at once;
    `_call`'s retries (0.05 + 0.1 + 0.2 s) all land in that wait. After a 40 s outage the
    client got through 4.8 s after the daemon was back, after 90 s 18.7 s (the backoff grows
    1.6x a try, to 120 s); with a lease of that order the engine lapses meanwhile."""
    proxy = rig.proxy
    with Client(f"127.0.0.1:{proxy.port}", engine_id="blip", timeout_s=5) as c:
        c.stats()
        proxy.go_down()
        threading.Timer(0.05, lambda: setattr(proxy, "down", False)).start()
        try:
            c.stats()  # retried on UNAVAILABLE for 0.35 s: the outage ends after 0.05 s
        finally:
            time.sleep(0.1)
            proxy.disarm()


def test_a_call_after_a_failed_load_is_health_checked_first(rig: Rig) -> None:
    """The module's rule: a call not safe to repeat goes after a health check when the
    connection failed last time, so that an Unavailable can say 'the call was not sent'
    (the engine then knows no lock or allocation was made). A failed Load (sent once
    too, yet outside `_call`) leaves the client believing the connection is up."""
    proxy = rig.proxy
    with Client(f"127.0.0.1:{proxy.port}", engine_id="loader", timeout_s=5) as c:
        c.attach(map_pools=False)
        m = c.match(np.arange(1, 1 + 2 * PAGE, dtype="<u4").tobytes(), lock=True)
        proxy.go_down()
        try:
            with pytest.raises(Unavailable):
                list(c.load(m.lock_id))
            with pytest.raises(Unavailable, match="was not sent"):
                c.match(np.arange(1, 1 + PAGE, dtype="<u4").tobytes(), lock=True, allocate_tokens=PAGE)
        finally:
            proxy.disarm()


def test_handles_a_lock_block_could_not_release_are_released_once_the_daemon_is_back(rig: Rig) -> None:
    """Found by the fuzz (a block's error during a fault): `_released_on_exit` raises
    the block's error and only logs the failed release, saying the engine's lease frees
    the handles; but the heartbeat gets through again once the daemon is reachable and
    renews the lease, so nothing ever frees them, and the engine, which saw only its own
    error, does not know it should (L1 pages lost while the engine lives). (A block that
    ends well raises the release's Unavailable instead: the engine is told.)"""
    proxy = rig.proxy
    prompt = np.arange(7_000, 7_000 + 2 * PAGE, dtype="<u4").tobytes()
    with Client(f"127.0.0.1:{proxy.port}", engine_id="unreleased", timeout_s=5) as c:
        c.attach(map_pools=False)
        with pytest.raises(RuntimeError, match="engine kernel failed"), \
                c.matched(prompt, allocate_tokens=2 * PAGE):
            proxy.go_down()  # (the release's retries cover 1.3 s; a longer outage than
            # the lease's 1.5 s would lapse the engine: the owed release after a longer
            # one is tests/daemon/test_units.py's)
            threading.Timer(0.6, lambda: setattr(proxy, "down", False)).start()
            raise RuntimeError("engine kernel failed")  # the block's error, seen as it should be
        deadline = time.monotonic() + 10
        while True:  # the daemon is reachable again (the lease outlived the outage)
            try:
                held = c.heartbeat()
                break
            except Unavailable:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            except NotFound:
                # (a loaded machine stalled this process past the 1.5 s lease: the lapse
                # freed the handles; attached again, the engine holds nothing either)
                c.attach(map_pools=False)
        assert (held.locks, held.allocations) == (0, 0)


def test_a_call_on_a_closed_client_raises_a_hicache_error(tmp_path: Path) -> None:
    """An engine's scheduler thread still calling while its shutdown path closed the client
    (or an `on_detached` callback attaching after close) got a ValueError that no
    `except HicacheError` catches. (A call in flight when close() runs fails the same way:
    FailedPrecondition, the client is closed.)"""
    c = Client(f"unix://{tmp_path}/nobody.sock", engine_id="closed", timeout_s=1)
    c.close()
    for call in (c.stats, lambda: c.match(b"\x01\x00\x00\x00", lock=True), lambda: list(c.load(1))):
        with pytest.raises(HicacheError):
            call()


def test_a_call_reaching_a_stopping_daemon_fails_unavailable(rig: Rig) -> None:
    """Found by the fuzz (a SIGTERM restart mid-step: an Insert failed so). gRPC's server
    stop cancels the calls that arrive during its grace period: here a Stats held back at
    the proxy until the daemon got SIGTERM. Its message says nothing, its type is no
    `Unavailable` (an engine's "daemon away" handling misses it), and a call safe to
    repeat is not retried. Stops the module's daemon: the module's last test."""
    proxy = rig.proxy
    failed: list[HicacheError] = []
    with Client(f"127.0.0.1:{proxy.port}", engine_id="late", timeout_s=10) as c:
        c.stats()
        proxy.gate = gate = threading.Event()

        def call() -> None:
            try:
                c.stats()
            except HicacheError as e:
                failed.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.2)  # the request waits at the gate
        try:
            assert rig.daemon.proc is not None
            os.kill(rig.daemon.proc.pid, signal.SIGTERM)
            time.sleep(0.3)  # the daemon is stopping
        finally:
            gate.set()
            proxy.gate = None
            caller.join()
        assert rig.daemon.proc.wait(30) == 0
    assert all(isinstance(e, Unavailable) for e in failed), [repr(e) for e in failed]
