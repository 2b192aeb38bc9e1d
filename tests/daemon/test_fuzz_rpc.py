"""A fuzz of the gRPC surface against one real daemon process, through the raw generated
stubs (any field value can be sent) and raw byte bodies (any bytes can be sent).

Every RPC of HiCache (and Batch with random mixes of ops, empty ones included), Admin and
grpc.health.v1 gets requests with random field values: token bytes of odd, page-aligned,
over-the-limit and over-the-message-size lengths; uint32/uint64 extremes and live handles
for ids and counts; empty, long and unicode/control-character strings; with or without the
`x-hicache-engine` header and the bearer token; optional fields set or unset; tiny
deadlines (abandoned calls); and bodies that are no valid message.

Invariants, per call: never INTERNAL or UNKNOWN (a crash in our code), only the codes the
contract lists, a message on every error; replies consistent with their requests (page
aligned counts, page ids in range, one id per page); L1 pages handed out (allocations) never
shared with another held allocation or a locked match. After the fuzz: the daemon serves,
no page stays locked once every engine's handles are gone (a re-Attach under a new
instance id releases them), the whole L1 can be allocated again (no page leaked), a normal
request life still works, and the log holds no traceback.

The daemon: daemonkit's TINY sizes with 32 L1 pages, a file L3 (prefetches happen), bearer
tokens (a tenant limited to two namespaces and an operator), write_through (the hunt ran
write_back too). The tests at the end reproduce bugs the fuzz found (each failed before its
fix; the rest are in test_requests.py and tests/controller/test_write_through.py).

Knobs for a longer hunt (defaults keep the file around 25 s):
HICACHE_FUZZ_CALLS (calls per thread), HICACHE_FUZZ_SEED, HICACHE_FUZZ_THREADS,
HICACHE_FUZZ_NOAUTH=1 (no bearer tokens), HICACHE_FUZZ_SETS (extra `--set`s, `;`-separated),
HICACHE_FUZZ_TRACE (a file to log every op and its outcome to), HICACHE_FUZZ_PROBE=1 (check
after every call that the allocations held are still there), HICACHE_FUZZ_LEASE_MS (a short
lease: engines lapse mid-fuzz), HICACHE_FUZZ_SHARED=1 (threads share engine ids).
"""

from __future__ import annotations

import collections
import functools
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.pb.hicache.v1 import admin_pb2_grpc as apb_grpc
from hicache.pb.hicache.v1 import hicache_pb2 as pb
from hicache.pb.hicache.v1 import hicache_pb2_grpc as pb_grpc

from .daemonkit import Daemon, tokens

CALLS = int(os.environ.get("HICACHE_FUZZ_CALLS", "3500"))
SEED = int(os.environ.get("HICACHE_FUZZ_SEED", "20261201"))
THREADS = int(os.environ.get("HICACHE_FUZZ_THREADS", "1"))
AUTH = os.environ.get("HICACHE_FUZZ_NOAUTH", "") != "1"
EXTRA_SETS = tuple(s for s in os.environ.get("HICACHE_FUZZ_SETS", "").split(";") if s)
TRACE = os.environ.get("HICACHE_FUZZ_TRACE", "")  # a file: every op and its outcome
PROBE = os.environ.get("HICACHE_FUZZ_PROBE", "") == "1"  # check held allocations after each call
# A short lease (engines lapse mid-fuzz): handles then go without a call, so the checks of
# what this side holds ("vanished", "pages shared") are off.
LEASE_MS = int(os.environ.get("HICACHE_FUZZ_LEASE_MS", "0"))
# Threads share engine ids (races between one thread's re-Attach and another's calls); the
# checks of what a thread holds are off then too.
SHARED = os.environ.get("HICACHE_FUZZ_SHARED", "") == "1"

MAX_TOKENS = 8192  # server.max_tokens_per_request of daemonkit's TINY config
TENANT = "fuzz-tenant-token-0123456789"
ADMIN = "fuzz-admin-token-9876543210"
TENANT_NS = ("ns-a", "名前🙂")
NAMESPACES = ("", "ns-a", "ns-b", "名前🙂")
ENGINE_HEADER = "x-hicache-engine"
TIMEOUT_S = 10.0

U32 = (0, 1, 2, 63, 64, 65, 1024, MAX_TOKENS, MAX_TOKENS + 1, 2**31 - 1, 2**32 - 1)
U64 = (0, 1, 2, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1)
C = grpc.StatusCode
# What the contract lets a call answer (API.md "Status codes"), besides OK.
ALLOWED = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED,
           C.PERMISSION_DENIED, C.UNAUTHENTICATED, C.DEADLINE_EXCEEDED}
NEVER_IN_BATCH = {0, C.INTERNAL.value[0], C.UNKNOWN.value[0]}
CODES = {c.value[0]: c for c in C}
SVC = "/hicache.v1.HiCache/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
ADMIN_SVC = "/hicache.v1.Admin/"

# BatchOp field -> (request class, unary method name)
OPS: dict[str, tuple[type, str]] = {
    "attach": (pb.AttachRequest, "Attach"),
    "heartbeat": (pb.HeartbeatRequest, "Heartbeat"),
    "match_prefix": (pb.MatchPrefixRequest, "MatchPrefix"),
    "prefetch_status": (pb.PrefetchStatusRequest, "PrefetchStatus"),
    "cancel_prefetch": (pb.CancelPrefetchRequest, "CancelPrefetch"),
    "allocate": (pb.AllocateRequest, "Allocate"),
    "insert": (pb.InsertRequest, "Insert"),
    "release": (pb.ReleaseRequest, "Release"),
    "close_session": (pb.CloseSessionRequest, "CloseSession"),
    "stats": (pb.StatsRequest, "Stats"),
}
METHOD_OP = {method: kind for kind, (_, method) in OPS.items()}


def daemon_sets(l3_dir: str) -> tuple[str, ...]:
    sets = [
        "tiers.l1.tokens=2048", "storage.backend=file", f"storage.file.path={l3_dir}",
        "prefetch.threshold_tokens=64", "write.selective_threshold=1",
        "prefetch.timeout_base_s=0.5", "prefetch.timeout_max_s=2",
    ]
    if AUTH:
        sets.append(f"server.tokens=[{{token: {TENANT}, namespaces: ['ns-a', '名前🙂']}}, "
                    f"{{token: {ADMIN}, namespaces: ['*']}}]")
    if LEASE_MS:
        sets.append(f"server.lease_ms={LEASE_MS}")
    return (*sets, *EXTRA_SETS)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("fuzz")
    d = Daemon(work, *daemon_sets(str(work / "l3"))).start()
    yield d
    d.close()


# ----------------------------------------------------------------------------- helpers


@dataclass
class Geometry:
    page: int
    num_pages: dict[str, int]  # member -> pages of its L1 pool
    lease_ms: int


@dataclass
class Failure:
    what: str
    call: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.what}] {self.call}: {self.detail}"


@dataclass
class Held:
    """A handle this thread got and still believes it holds, with its L1 pages."""
    ns: str
    pages: dict[str, set[int]]
    tokens: bytes = b""
    # A lock's: the allocation its match made, whose first pages a Load lands in.
    partner: Any = None


@dataclass
class Thread:
    index: int
    rng: random.Random
    names: tuple[str, ...]  # engine ids this thread attaches
    locks: dict[tuple[str, str, int], Held] = field(default_factory=dict)
    allocs: dict[tuple[str, str, int], Held] = field(default_factory=dict)
    # Every handle ever seen, for the fuzz to pick (stale ones are fine).
    seen_locks: list[tuple[str, str, int, str, bytes]] = field(default_factory=list)
    seen_allocs: list[tuple[str, str, int, str]] = field(default_factory=list)
    seen_prefetches: list[tuple[str, str, int]] = field(default_factory=list)
    sessions: list[str] = field(default_factory=lambda: ["s1", "s2"])
    calls: int = 0


def page_ids(data: bytes) -> list[int]:
    return [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]


def text(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return rng.choice(["", "a", "s1", "s2", "ns-a"])
    if r < 0.5:
        return rng.choice(["\x00", "\t\n\r\x1b", "\u202e\u200b\ufeff", "名前🙂", "\U0010ffff",
                           "a\x00b", " ", "/", "token#0/x", "'\"{}%s%n", "\x7f\x80\x9f"])
    if r < 0.9:
        pick = (lambda: rng.randrange(0x20, 0x7F), lambda: rng.randrange(0, 0x20),
                lambda: rng.randrange(0xA0, 0xD800), lambda: rng.randrange(0xE000, 0x110000))
        return "".join(chr(rng.choice(pick)()) for _ in range(rng.randrange(1, 40)))
    return rng.choice(["x", "é", "🙂"]) * rng.choice([255, 256, 257, 288, 289, 5000, 60000])


class Fuzzer:
    def __init__(self, daemon: Daemon, geometry: Geometry, families: list[bytes]) -> None:
        self.d = daemon
        self.g = geometry
        self.families = families
        self.channel = grpc.insecure_channel(daemon.target)
        self.stub = pb_grpc.HiCacheStub(self.channel)
        self.admin = apb_grpc.AdminStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.failures: list[Failure] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self._mu = threading.Lock()

    def close(self) -> None:
        self.channel.close()

    def trace(self, t: Thread, line: str) -> None:
        if TRACE:
            with self._mu, open(TRACE, "a") as f:
                f.write(f"#{t.calls} T{t.index} {line[:700]}\n")

    def fail(self, what: str, call: str, detail: str) -> None:
        if (LEASE_MS or SHARED) and what in ("vanished", "pages shared"):
            return
        with self._mu:
            self.failures.append(Failure(what, call, detail[:600]))

    # ------------------------------------------------------------------ values

    def u32(self, t: Thread) -> int:
        return t.rng.choice(U32) if t.rng.random() < 0.7 else t.rng.randrange(2**32)

    def u64(self, t: Thread) -> int:
        return t.rng.choice(U64) if t.rng.random() < 0.7 else t.rng.randrange(2**64)

    def ns(self, t: Thread) -> str:
        return t.rng.choice(NAMESPACES) if t.rng.random() < 0.85 else text(t.rng)

    def session(self, t: Thread) -> str:
        r = t.rng.random()
        if r < 0.5:
            return ""
        if r < 0.85:
            return t.rng.choice(t.sessions)
        s = text(t.rng)
        if len(t.sessions) < 50:
            t.sessions.append(s)
        return s

    def tokens(self, t: Thread) -> bytes:
        rng, page = t.rng, self.g.page
        r = rng.random()
        if r < 0.6:  # a prefix of a family (hits), maybe a partial last page
            fam = rng.choice(self.families)
            n = rng.randrange(0, len(fam) // 4 // page + 1) * page
            if rng.random() < 0.3 and page > 1:
                n += rng.randrange(1, page)
            return fam[: 4 * min(n, len(fam) // 4)]
        if r < 0.7:
            return rng.randbytes(rng.choice([1, 2, 3, 5, 7, 4 * page + 1, 4 * page - 1]))
        if r < 0.8:
            return rng.randbytes(4 * rng.randrange(0, 3 * page))
        if r < 0.88:
            return b"\xff\xff\xff\xff" * page * rng.randrange(1, 3)
        if r < 0.95:
            return tokens(rng.choice([MAX_TOKENS, MAX_TOKENS + 1]), start=rng.randrange(1, 1 << 30))
        if r < 0.99:
            return b""
        return b"\x00" * (4 * 300_000 + rng.choice([0, 1]))  # over the message size limit

    def pick_lock(self, t: Thread, who: tuple[str, str]) -> tuple[int, str, bytes] | None:
        mine = [x for x in t.seen_locks if x[0] == who[0] and x[1] == who[1]]
        pool = mine if mine and t.rng.random() < 0.85 else t.seen_locks
        if not pool or t.rng.random() < 0.3:
            return None
        _, _, lock_id, ns, toks = t.rng.choice(pool[-40:])
        return lock_id, ns, toks

    def pick_alloc(self, t: Thread, who: tuple[str, str]) -> tuple[int, str] | None:
        mine = [x for x in t.seen_allocs if x[0] == who[0] and x[1] == who[1]]
        pool = mine if mine and t.rng.random() < 0.85 else t.seen_allocs
        if not pool or t.rng.random() < 0.3:
            return None
        _, _, alloc_id, ns = t.rng.choice(pool[-40:])
        return alloc_id, ns

    def handle(self, t: Thread, picked: int | None) -> int:
        return picked if picked is not None else self.u64(t)

    # ------------------------------------------------------------------ requests

    def request(self, t: Thread, kind: str, who: tuple[str, str]) -> Any:
        rng = t.rng
        if kind == "attach":
            r = pb.AttachRequest(
                engine_id=rng.choice(t.names) if rng.random() < 0.6 else text(rng),
                tp_rank=0 if rng.random() < 0.7 else self.u32(t),
                tp_size=1 if rng.random() < 0.7 else self.u32(t),
            )
            r.instance_id = rng.choice(["", "", "inst", text(rng)])
            return r
        if kind == "heartbeat":
            return pb.HeartbeatRequest(
                engine_id=who[1] if rng.random() < 0.6 else rng.choice([*t.names, text(rng)]),
                tp_rank=0 if rng.random() < 0.7 else self.u32(t),
                instance_id=rng.choice(["", "inst", text(rng)]),
            )
        if kind == "match_prefix":
            r = pb.MatchPrefixRequest(
                namespace=self.ns(t), tokens=self.tokens(t), session_id=self.session(t),
                request_id=text(rng) if rng.random() < 0.3 else "",
                lock=rng.random() < 0.6, prefetch=rng.random() < 0.4,
            )
            if rng.random() < 0.5:
                n = len(r.tokens) // 4
                r.allocate_tokens = (n + rng.randrange(0, 3 * self.g.page)
                                     if rng.random() < 0.7 else self.u32(t))
            return r
        if kind in ("prefetch_status", "cancel_prefetch"):
            mine = [p for p in t.seen_prefetches if p[:2] == who]
            pid = rng.choice(mine)[2] if mine and rng.random() < 0.7 else self.u64(t)
            return OPS[kind][0](prefetch_id=pid)
        if kind == "allocate":
            r = pb.AllocateRequest(
                namespace=self.ns(t),
                num_tokens=rng.randrange(1, 4 * self.g.page) if rng.random() < 0.6 else self.u32(t),
            )
            if rng.random() < 0.4:
                lock = self.pick_lock(t, who)
                r.lock_id = self.handle(t, lock and lock[0])
                if lock and rng.random() < 0.8:
                    r.namespace = lock[1]
            if rng.random() < 0.4:
                alloc = self.pick_alloc(t, who)
                r.allocation_id = self.handle(t, alloc and alloc[0])
                if alloc and rng.random() < 0.8:
                    r.namespace = alloc[1]
            return r
        if kind == "insert":
            r = pb.InsertRequest(
                namespace=self.ns(t), tokens=self.tokens(t), session_id=self.session(t),
                request_id=text(rng) if rng.random() < 0.2 else "",
                mamba_checkpoint=rng.random() < 0.3, keep_lock=rng.random() < 0.3,
            )
            lock = self.pick_lock(t, who) if rng.random() < 0.7 else None
            if lock is not None or rng.random() < 0.3:
                r.lock_id = self.handle(t, lock and lock[0])
            alloc = self.pick_alloc(t, who) if rng.random() < 0.7 else None
            if alloc is not None or rng.random() < 0.3:
                r.allocation_id = self.handle(t, alloc and alloc[0])
            if lock is not None and rng.random() < 0.8:  # plausible: the matched prefix + more
                r.namespace, r.tokens = lock[1], lock[2]
                if rng.random() < 0.7:
                    more = rng.randrange(0, 3) * self.g.page + (rng.randrange(self.g.page)
                                                                 if rng.random() < 0.2 else 0)
                    fam = next((f for f in self.families if f.startswith(lock[2])), b"")
                    r.tokens = (fam[: len(lock[2]) + 4 * more] if fam
                                else lock[2] + rng.randbytes(4 * more))
            elif alloc is not None and rng.random() < 0.8:
                r.namespace = alloc[1]
            return r
        if kind == "release":
            r = pb.ReleaseRequest()
            c = rng.random()
            if c < 0.45:
                lock = self.pick_lock(t, who)
                r.lock_id = self.handle(t, lock and lock[0])
            elif c < 0.9:
                alloc = self.pick_alloc(t, who)
                r.allocation_id = self.handle(t, alloc and alloc[0])
            elif c < 0.95:
                r.lock_id, r.allocation_id = self.u64(t), self.u64(t)  # oneof: the last wins
            return r
        if kind == "close_session":
            return pb.CloseSessionRequest(session_id=self.session(t) if rng.random() < 0.8
                                          else text(rng))
        if kind == "stats":
            return pb.StatsRequest()
        raise AssertionError(kind)

    def metadata(self, t: Thread) -> tuple[tuple[tuple[str, str], ...], tuple[str, str]]:
        """(metadata, who): who = (principal as the daemon knows it, engine id sent)."""
        rng = t.rng
        md: list[tuple[str, str]] = []
        principal = "anonymous"
        if AUTH:
            r = rng.random()
            if r < 0.5:
                md.append(("authorization", f"Bearer {ADMIN}"))
                principal = "token#1"
            elif r < 0.9:
                md.append(("authorization", f"Bearer {TENANT}"))
                principal = "token#0"
            else:
                md.append(("authorization", rng.choice(["Bearer nope", "Basic abc", "Bearer ",
                                                        "bearer  " + TENANT + "  ", "x" * 300])))
                principal = "token#0" if md[-1][1].startswith("bearer  ") else "none"
        r = rng.random()
        engine = ""
        if r < 0.8:
            engine = rng.choice(t.names)
        elif r < 0.85:
            engine = f"fz{t.index}-ghost"
        elif r < 0.9:
            engine = rng.choice(["", "fz-unattached", "y" * 300, "token#1/fz0a"])
        if r < 0.9:
            md.append((ENGINE_HEADER, engine))
            if rng.random() < 0.05:
                md.append((ENGINE_HEADER, rng.choice(t.names)))  # twice: the first counts
        if rng.random() < 0.05:
            md.append(("x-other", text(rng).encode("ascii", "replace").decode()[:50] or "v"))
            md = [(k, v) for k, v in md if v.isprintable() and v.isascii()]
        rng.shuffle(md)
        engine = next((v for k, v in md if k == ENGINE_HEADER), "")  # the first one counts
        return tuple(md), (principal, engine)

    # ------------------------------------------------------------------ checks of replies

    def check_pages(self, call: str, member_pages: Any, expect: int | None) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for mp in member_pages:
            if len(mp.page_ids) % 4:
                self.fail("reply", call, f"member {mp.member}: {len(mp.page_ids)} bytes of ids")
                continue
            ids = page_ids(mp.page_ids)
            limit = self.g.num_pages.get(mp.member)
            if limit is None:
                self.fail("reply", call, f"unknown member {mp.member!r}")
                continue
            bad = [i for i in ids if not (0 <= i < limit or i == -1)]
            if bad:
                self.fail("reply", call, f"member {mp.member}: page ids {bad[:5]} outside [0, {limit})")
            real = [i for i in ids if i >= 0]
            if len(set(real)) != len(real):
                self.fail("reply", call, f"member {mp.member}: a page id listed twice: {ids}")
            if expect is not None and mp.member == "full" and len(ids) != expect:
                self.fail("reply", call, f"member full: {len(ids)} page ids, expected {expect}")
            out[mp.member] = set(real)
        if expect and "full" not in out and "full" in self.g.num_pages:
            self.fail("reply", call, f"no page ids of member full (expected {expect})")
        return out

    def check_disjoint(self, t: Thread, call: str, key: Any, pages: dict[str, set[int]]) -> None:
        """L1 pages of a held allocation are in no other held allocation and no locked
        match (two locks may share pages: two matches of one prefix)."""
        tables = (t.allocs,) if key in t.locks else (t.allocs, t.locks)
        for table in tables:
            for other, held in table.items():
                if other == key:
                    continue
                for member, ids in pages.items():
                    both = ids & held.pages.get(member, set())
                    if both:
                        self.fail("pages shared", call,
                                  f"{key}: member {member} pages {sorted(both)[:8]} are also held "
                                  f"by {other}")

    def forget_engine(self, t: Thread, who: tuple[str, str]) -> None:
        for table in (t.locks, t.allocs):
            for key in [k for k in table if k[:2] == who]:
                del table[key]

    def forget_principal(self, t: Thread, principal: str) -> None:
        for table in (t.locks, t.allocs):
            for key in [k for k in table if k[0] == principal]:
                del table[key]

    def forget_named(self, t: Thread, kind: str, who: tuple[str, str], req: Any) -> None:
        """An uncertain outcome (the call's deadline passed): what it names may be gone."""
        if kind == "attach":
            self.forget_engine(t, (who[0], req.engine_id))
            return
        for name, table in (("lock_id", t.locks), ("allocation_id", t.allocs)):
            if name in req.DESCRIPTOR.fields_by_name:
                table.pop((*who, getattr(req, name)), None)

    def observe(self, t: Thread, call: str, kind: str, req: Any, who: tuple[str, str],
                resp: Any | None, code: grpc.StatusCode | None, message: str,
                uncertain: bool) -> None:
        """One op's outcome: its invariants, and what this thread now holds."""
        page = self.g.page
        with self._mu:
            self.outcomes[f"{kind}:{code.name if code else 'OK'}"] += 1
        if TRACE:
            outcome = (str(resp).replace("\n", " ")[:300] if resp is not None
                       else f"{code and code.name} {message[:200]} uncertain={uncertain}")
            with self._mu, open(TRACE, "a") as f:
                f.write(f"#{t.calls} ")
                op = str(req).replace("\n", " ")
                where = call.split("(", 1)[0] + (call[call.rindex(" op "):] if " op " in call else "")
                f.write(f"T{t.index} {who} {where} {kind}({op[:300]})\n    -> {outcome}\n")
        if resp is None:
            if uncertain:
                self.forget_named(t, kind, who, req)
            elif kind == "release" and code is C.NOT_FOUND:
                target = req.WhichOneof("target")
                key = (*who, getattr(req, target)) if target else None
                if key in t.locks or key in t.allocs:
                    self.fail("vanished", call, f"{key} was held, Release says: {message}")
            if kind == "insert":  # (failed: nothing changed; kept simple: forget)
                self.forget_named(t, kind, who, req)
            return
        if kind == "attach":
            if req.instance_id:
                self.forget_engine(t, (who[0], req.engine_id))
            if resp.page_size != page:
                self.fail("reply", call, f"page_size {resp.page_size}")
        elif kind == "heartbeat":
            if resp.lease_ms != self.g.lease_ms:
                self.fail("reply", call, f"lease_ms {resp.lease_ms}")
        elif kind == "match_prefix":
            n = len(req.tokens) // 4 // page * page
            d, h, s = resp.device_tokens, resp.host_tokens, resp.storage_tokens
            if d % page or h % page or s % page or d + h + s > n:
                self.fail("reply", call, f"tokens device {d} host {h} storage {s} of {n}")
            device = self.check_pages(call, resp.device_pages, d // page)
            wants_lock = req.lock or req.HasField("allocate_tokens")
            if bool(resp.lock_id) != wants_lock:
                self.fail("reply", call, f"lock_id {resp.lock_id} for lock={req.lock} "
                                         f"allocate={req.HasField('allocate_tokens')}")
            if bool(resp.allocation_id) != req.HasField("allocate_tokens"):
                self.fail("reply", call, f"allocation_id {resp.allocation_id}")
            if resp.prefetch_id and not req.prefetch:
                self.fail("reply", call, f"prefetch_id {resp.prefetch_id} without prefetch")
            if resp.lock_id:
                key = (*who, resp.lock_id)
                t.seen_locks.append((*who, resp.lock_id, req.namespace, req.tokens))
                t.locks[key] = Held(req.namespace, device, req.tokens)
                self.check_disjoint(t, call, key, device)
            if resp.allocation_id:
                want = -(-max(0, req.allocate_tokens - d) // page)
                pages = self.check_pages(call, resp.pages, want)
                key = (*who, resp.allocation_id)
                t.seen_allocs.append((*who, resp.allocation_id, req.namespace))
                t.allocs[key] = Held(req.namespace, pages)
                self.check_disjoint(t, call, key, pages)
                if resp.lock_id:
                    t.locks[(*who, resp.lock_id)].partner = key
            elif resp.pages:
                self.fail("reply", call, "pages without an allocation")
            if resp.prefetch_id:
                t.seen_prefetches.append((*who, resp.prefetch_id))
        elif kind == "allocate":
            grow = req.HasField("allocation_id")
            want = -(-req.num_tokens // page)
            pages = self.check_pages(call, resp.pages, None)
            got = len(page_ids(next((p.page_ids for p in resp.pages if p.member == "full"), b"")))
            if (got < want) if grow else (got != want and "full" in self.g.num_pages):
                self.fail("reply", call, f"{got} pages for {req.num_tokens} tokens (grow={grow})")
            if grow and resp.allocation_id != req.allocation_id:
                self.fail("reply", call, f"grew {req.allocation_id} but answered {resp.allocation_id}")
            key = (*who, resp.allocation_id)
            if not grow:
                t.seen_allocs.append((*who, resp.allocation_id, req.namespace))
            if not grow or key in t.allocs:
                t.allocs[key] = Held(req.namespace, pages)
                self.check_disjoint(t, call, key, pages)
        elif kind == "insert":
            n = len(req.tokens) // 4 // page * page
            i, r = resp.inserted_tokens, resp.reused_tokens
            # (inserted: new to the tree, reused: held already; they add up to the whole
            # sequence. NOTE: hicache.proto's "Of those" comment says reused is part of
            # inserted, which neither the daemon nor its tests do.)
            if i % page or r % page or i + r != n:
                self.fail("reply", call, f"inserted {i} reused {r} of {n} tokens")
            self.forget_named(t, kind, who, req)
        elif kind == "release":
            target = req.WhichOneof("target")
            (t.locks if target == "lock_id" else t.allocs).pop((*who, getattr(req, target)), None)
        elif kind == "prefetch_status":
            if resp.state == pb.PREFETCH_STATE_UNSPECIFIED or resp.tokens_ready % page \
                    or resp.tokens_total % page or resp.tokens_ready > resp.tokens_total:
                self.fail("reply", call, f"prefetch {resp}")
        elif kind == "cancel_prefetch":
            if resp.tokens_ready % page:
                self.fail("reply", call, f"tokens_ready {resp.tokens_ready}")
        elif kind == "stats":
            for p in resp.pools:
                if p.used_pages > p.capacity_pages or p.locked_pages > p.capacity_pages:
                    self.fail("reply", call, f"pool {p}")

    # ------------------------------------------------------------------ calls

    def status_ok(self, call: str, e: grpc.RpcError, tiny: bool) -> None:
        code, details = e.code(), e.details() or ""
        allowed = ALLOWED | ({C.CANCELLED} if tiny else set())
        if code not in allowed:
            self.fail(code.name, call, details)
        elif not details.strip():
            self.fail("no message", call, code.name)
        elif code is C.DEADLINE_EXCEEDED and not tiny and \
                "deadline left to reply" not in details:
            self.fail("hang", call, f"no answer in {TIMEOUT_S} s")

    def timeout(self, t: Thread) -> tuple[float, bool]:
        if t.rng.random() < 0.06:
            return t.rng.choice([0.0002, 0.001, 0.003, 0.006, 0.02]), True
        return TIMEOUT_S, False

    def describe(self, method: str, req: Any, md: Any) -> str:
        body = str(req).replace("\n", " ")
        if len(body) > 300:
            body = body[:300] + "..."
        return f"{method}({body}) md={[(k, v[:40]) for k, v in md]}"

    def unary(self, t: Thread, kind: str, req: Any = None, mw: Any = None) -> Any:
        """One unary call (random unless given `req` and `mw` = (metadata, who)); its
        response, or None when it failed."""
        md, who = mw or self.metadata(t)
        if req is None:
            req = self.request(t, kind, who)
        method = OPS[kind][1]
        timeout, tiny = self.timeout(t)
        call = self.describe(method, req, md)
        op_who = who if kind not in ("attach", "heartbeat") else (who[0], req.engine_id)
        self.sent += 1
        try:
            resp = getattr(self.stub, method)(req, metadata=md, timeout=timeout)
        except grpc.RpcError as e:
            self.status_ok(call, e, tiny)
            self.observe(t, call, kind, req, op_who, None, e.code(), e.details() or "",
                         uncertain=e.code() in (C.DEADLINE_EXCEEDED, C.CANCELLED))
            return None
        self.observe(t, call, kind, req, op_who, resp, None, "", False)
        return resp

    def batch(self, t: Thread, req: Any = None, mw: Any = None) -> list[Any]:
        """One Batch call (random unless given `req` and `mw`): per op, its response or
        None."""
        md, who = mw or self.metadata(t)
        rng = t.rng
        if req is None:
            n = rng.choice([0, 1, 1, 2, 3, 4, 6, 8, 12]) if rng.random() < 0.95 else rng.randrange(50, 300)
            req = pb.BatchRequest()
            for _ in range(n):
                op = req.ops.add()
                if rng.random() < 0.08:
                    continue  # an empty op
                kind = rng.choice(list(OPS))
                getattr(op, kind).CopyFrom(self.request(t, kind, who))
        out: list[Any] = [None] * len(req.ops)
        timeout, tiny = self.timeout(t)
        call = self.describe("Batch", req, md)
        self.sent += 1
        try:
            resp = self.stub.Batch(req, metadata=md, timeout=timeout)
        except grpc.RpcError as e:
            self.status_ok(call, e, tiny)
            for op in req.ops:
                kind = op.WhichOneof("op")
                if kind:
                    msg = getattr(op, kind)
                    op_who = who if kind not in ("attach", "heartbeat") else (who[0], msg.engine_id)
                    self.forget_named(t, kind, op_who, msg)
            return out
        if len(resp.results) != len(req.ops):
            self.fail("reply", call, f"{len(resp.results)} results for {len(req.ops)} ops")
            return out
        for i, (op, res) in enumerate(zip(req.ops, resp.results, strict=True)):
            kind, got = op.WhichOneof("op"), res.WhichOneof("result")
            op_call = f"{call} op {i} ({kind})"
            if got == "status":
                if res.status.code in NEVER_IN_BATCH or \
                        res.status.code not in {c.value[0] for c in ALLOWED}:
                    self.fail(f"batch code {res.status.code}", op_call, res.status.message)
                if not res.status.message.strip():
                    self.fail("no message", op_call, f"code {res.status.code}")
                if kind is None:
                    continue
                msg = getattr(op, kind)
                op_who = who if kind not in ("attach", "heartbeat") else (who[0], msg.engine_id)
                self.observe(t, op_call, kind, msg, op_who, None, CODES.get(res.status.code),
                             res.status.message, uncertain=False)
                continue
            if kind is None or got != kind:
                self.fail("reply", op_call, f"result {got} for op {kind}")
                continue
            msg = getattr(op, kind)
            op_who = who if kind not in ("attach", "heartbeat") else (who[0], msg.engine_id)
            self.observe(t, op_call, kind, msg, op_who, getattr(res, kind), None, "", False)
            out[i] = getattr(res, kind)
        return out

    def send(self, t: Thread, kind: str, req: Any, mw: Any) -> Any:
        """`req` as a unary call or (30%) a Batch of one op."""
        if t.rng.random() < 0.7:
            return self.unary(t, kind, req, mw)
        batch = pb.BatchRequest()
        getattr(batch.ops.add(), kind).CopyFrom(req)
        return self.batch(t, batch, mw)[0]

    def restart(self, t: Thread) -> None:
        """An engine process restarts: its predecessor's locks and allocations go."""
        principal, token = t.rng.choice(principals())
        engine = t.rng.choice(t.names)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        self.send(t, "attach", pb.AttachRequest(engine_id=engine, tp_size=1,
                                                instance_id=uuid.uuid4().hex), (md, (principal, "")))

    def life(self, t: Thread) -> None:
        """A plausible request life (so that the tree, L2, L3 and prefetches fill up):
        match with a lock and an allocation, maybe load, prefetch, grow, insert mid-way
        (keep_lock), insert, release what is left; the same invariants apply."""
        rng, page = t.rng, self.g.page
        principal, token = rng.choice(principals())
        engine = rng.choice(t.names)
        md: list[tuple[str, str]] = [(ENGINE_HEADER, engine)]
        if token:
            md.append(("authorization", f"Bearer {token}"))
        mw = (tuple(md), (principal, engine))
        ns = rng.choice(TENANT_NS if token == TENANT else NAMESPACES)
        fam = rng.choice(self.families)
        n = rng.randrange(1, min(12, len(fam) // 4 // page) + 1) * page
        prompt = fam[: 4 * n]
        session = rng.choice(["", "", *t.sessions[:4]])
        m = self.send(t, "match_prefix", pb.MatchPrefixRequest(
            namespace=ns, tokens=prompt, lock=True, prefetch=rng.random() < 0.6,
            session_id=session, allocate_tokens=n + rng.choice([0, 0, page // 2, page])), mw)
        if m is None:
            return
        if m.prefetch_id:
            for _ in range(rng.randrange(0, 3)):
                self.send(t, "prefetch_status", pb.PrefetchStatusRequest(prefetch_id=m.prefetch_id), mw)
            if rng.random() < 0.3:
                self.send(t, "cancel_prefetch", pb.CancelPrefetchRequest(prefetch_id=m.prefetch_id), mw)
        if m.host_tokens and rng.random() < 0.7:
            self.load(t, pb.LoadRequest(lock_id=m.lock_id), mw)
        if rng.random() < 0.2:
            self.send(t, "allocate", pb.AllocateRequest(namespace=ns, num_tokens=page,
                                                        allocation_id=m.allocation_id), mw)
        keep = rng.random() < 0.3
        self.send(t, "insert", pb.InsertRequest(
            namespace=ns, tokens=prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
            keep_lock=keep, session_id=session, mamba_checkpoint=rng.random() < 0.8), mw)
        if keep:
            more = fam[: 4 * min(len(fam) // 4, n + page * rng.randrange(0, 2))]
            if rng.random() < 0.5:
                self.send(t, "allocate", pb.AllocateRequest(namespace=ns, num_tokens=2 * page,
                                                            allocation_id=m.allocation_id), mw)
            self.send(t, "insert", pb.InsertRequest(
                namespace=ns, tokens=more, lock_id=m.lock_id, allocation_id=m.allocation_id,
                mamba_checkpoint=rng.random() < 0.8), mw)
        if rng.random() < 0.6:  # (usually consumed by the insert: NOT_FOUND)
            self.send(t, "release", pb.ReleaseRequest(lock_id=m.lock_id), mw)
            self.send(t, "release", pb.ReleaseRequest(allocation_id=m.allocation_id), mw)
        if session and rng.random() < 0.1:
            self.send(t, "close_session", pb.CloseSessionRequest(session_id=session), mw)

    def load(self, t: Thread, req: Any = None, mw: Any = None) -> None:
        md, who = mw or self.metadata(t)
        if req is None:
            lock = self.pick_lock(t, who)
            req = pb.LoadRequest(lock_id=self.handle(t, lock and lock[0]))
        timeout, tiny = self.timeout(t)
        call = self.describe("Load", req, md)
        self.sent += 1
        last = None
        cancel = t.rng.random() < float(os.environ.get("HICACHE_FUZZ_LOAD_CANCEL", "0.25"))  # the engine gives up on the stream after a message
        try:
            stream = self.stub.Load(req, metadata=md, timeout=timeout)
            for progress in stream:
                if last is not None and progress.layers_ready < last.layers_ready:
                    self.fail("reply", call, "layers_ready went back")
                last = progress
                if cancel:
                    stream.cancel()
                    self.trace(t, f"{call} -> cancelled after {last}")
                    t.locks.pop((*who, req.lock_id), None)
                    return
        except grpc.RpcError as e:
            self.trace(t, f"{call} -> {e.code().name} {e.details()}")
            self.status_ok(call, e, tiny)
            if e.code() in (C.DEADLINE_EXCEEDED, C.CANCELLED):
                t.locks.pop((*who, req.lock_id), None)
            return
        self.trace(t, f"{call} -> {last}")
        if last is None or last.layers_ready != last.layers_total:
            self.fail("reply", call, f"the stream ended at {last}")
            return
        if last.device_tokens % self.g.page:
            self.fail("reply", call, f"device_tokens {last.device_tokens}")
        pages = self.check_pages(call, last.device_pages, last.device_tokens // self.g.page)
        key = (*who, req.lock_id)
        if key in t.locks:
            t.locks[key].pages = pages
            partner = t.allocs.get(t.locks[key].partner)
            if partner is not None:  # (its first pages now hold the loaded part: the lock's)
                for member, ids in pages.items():
                    partner.pages[member] = partner.pages.get(member, set()) - ids
            self.check_disjoint(t, call, key, pages)

    def admin_call(self, t: Thread) -> None:
        md, _ = self.metadata(t)
        rng = t.rng
        timeout, tiny = self.timeout(t)
        r = rng.random()
        if r < 0.4:
            req: Any = apb.HealthRequest(deep=rng.random() < 0.5)
            fn: Callable[..., Any] = self.admin.Health
        elif r < 0.7:
            req = apb.FlushRequest(timeout_ms=rng.choice([0, 1, 100, 2000, 2**31 - 1, 2**32 - 1]))
            fn = self.admin.Flush
        else:
            req = health_pb2.HealthCheckRequest(
                service=rng.choice(["", "hicache.v1.HiCache", "hicache.v1.Admin", text(rng)]))
            fn = self.health.Check
        call = self.describe(type(req).__name__, req, md)
        self.sent += 1
        try:
            fn(req, metadata=md, timeout=timeout)
            self.trace(t, f"{call} -> OK")
        except grpc.RpcError as e:
            self.trace(t, f"{call} -> {e.code().name} {e.details()}")
            self.status_ok(call, e, tiny)

    # ------------------------------------------------------------------ bodies that are no message

    def garbage(self, t: Thread) -> None:
        rng = t.rng
        methods = [SVC + m for m in (*METHOD_OP, "Batch")] + \
            [ADMIN_SVC + "Health", ADMIN_SVC + "Flush", "/grpc.health.v1.Health/Check", REFLECTION]
        method = rng.choice(methods)
        kind = METHOD_OP.get(method.rsplit("/", 1)[1])
        md, who = self.metadata(t)
        valid = self.request(t, kind, who).SerializeToString() if kind else b"\x0a\x00" * 3
        c = rng.randrange(9)
        if c == 0:
            body = rng.randbytes(rng.randrange(1, 64))
        elif c == 1:
            body = valid[: rng.randrange(len(valid))] if len(valid) > 1 else b"\x0a"
        elif c == 2 and valid:
            i = rng.randrange(len(valid))
            body = valid[:i] + bytes([valid[i] ^ (1 << rng.randrange(8))]) + valid[i + 1 :]
        elif c == 3:
            body = b"\x0a\x03\xff\xfe\xfd" + valid  # field 1 as a string that is not UTF-8
        elif c == 4:
            body = b"\x12\xff\xff\xff\xff\x0fab"  # a length past the end
        elif c == 5:
            body = b"\x0b" * 150 + b"\x0c" * 150  # groups nested past the recursion limit
        elif c == 6:
            body = b"\x08" + b"\xff" * 11  # a varint longer than 10 bytes
        elif c == 7:  # a Batch op whose MatchPrefix namespace is not UTF-8
            inner = b"\x0a\x02\xc3\x28"
            op = b"\x1a" + bytes([len(inner)]) + inner
            body = b"\x0a" + bytes([len(op)]) + op
            method = SVC + "Batch"
        else:
            body = valid + rng.randbytes(rng.randrange(1, 16))
        timeout, tiny = self.timeout(t)
        call = f"raw {method} body={body[:80]!r}"
        self.sent += 1
        try:
            if method.endswith("/Load"):
                for _ in self.channel.unary_stream(method)(body, metadata=md, timeout=timeout):
                    pass
            elif method == REFLECTION:  # (a request stream: one message)
                list(self.channel.stream_stream(method)(iter([body]), metadata=md, timeout=timeout))
            else:
                self.channel.unary_unary(method)(body, metadata=md, timeout=timeout)
            self.trace(t, f"{call} md={md} -> OK")
            self.forget_principal(t, who[0])  # it decoded (a valid message after all) and ran
        except grpc.RpcError as e:
            self.trace(t, f"{call} md={md} -> {e.code().name} {e.details()}")
            self.status_ok(call, e, tiny)
            if e.code() in (C.DEADLINE_EXCEEDED, C.CANCELLED):
                self.forget_principal(t, who[0])
            if e.code() is C.INVALID_ARGUMENT and "not a valid message" not in (e.details() or "") \
                    and c in (4, 5, 6):
                self.fail("message", call, e.details() or "")

    # ------------------------------------------------------------------ the loop

    def run(self, t: Thread, calls: int) -> None:
        actions: list[tuple[float, Callable[[Thread], Any]]] = [
            *[(1.0, functools.partial(self.unary, kind=k)) for k in OPS],
            (3.0, lambda th: self.unary(th, "match_prefix")),
            (2.0, lambda th: self.unary(th, "insert")),
            (1.0, lambda th: self.unary(th, "allocate")),
            (1.0, lambda th: self.unary(th, "release")),
            (3.0, self.batch),
            (1.0, self.load),
            (0.5, self.admin_call),
            (1.5, self.garbage),
            (6.0, self.life),
            (0.3, self.restart),
        ]
        weights = [w for w, _ in actions]
        try:
            for _ in range(calls):
                t.rng.choices(actions, weights)[0][1](t)
                t.calls += 1
                if PROBE:
                    self.probe(t)
        except Exception as e:  # (a bug of the fuzzer's own, or a client-side error)
            self.fail("fuzzer crashed", f"thread {t.index} call {t.calls}", repr(e))

    def probe(self, t: Thread) -> None:
        """(A hunt's aid) every allocation this thread holds is still there: an Insert in a
        namespace no allocation has is refused INVALID_ARGUMENT, changing nothing."""
        for key in list(t.allocs):
            principal, engine, alloc_id = key
            token = {"token#1": ADMIN, "token#0": TENANT}.get(principal, "")
            md = [(ENGINE_HEADER, engine)] + ([("authorization", f"Bearer {token}")] if token else [])
            try:
                self.stub.Insert(pb.InsertRequest(namespace="\x00probe", allocation_id=alloc_id),
                                 metadata=md, timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                if e.code() is C.NOT_FOUND:
                    self.fail("vanished", f"after call {t.calls}", f"{key}: {e.details()}")
                    del t.allocs[key]


# ----------------------------------------------------------------------------- the test


def auth_md(engine: str = "") -> tuple[tuple[str, str], ...]:
    md = [(ENGINE_HEADER, engine)] if engine else []
    if AUTH:
        md.append(("authorization", f"Bearer {ADMIN}"))
    return tuple(md)


def principals() -> list[tuple[str, str]]:
    """(label, token) of every principal the fuzz calls as."""
    return [("token#1", ADMIN), ("token#0", TENANT)] if AUTH else [("anonymous", "")]


def attach_all(stub: Any, names: list[str], instance: str) -> None:
    for _, token in principals():
        md = (("authorization", f"Bearer {token}"),) if token else ()
        for name in names:
            stub.Attach(pb.AttachRequest(engine_id=name, tp_size=1, instance_id=instance),
                        metadata=md, timeout=TIMEOUT_S)


def test_fuzz_the_grpc_surface(fuzzed: Daemon) -> None:
    started = time.monotonic()
    log_from = len(fuzzed.log())  # (other tests of the module may log their own errors)
    with grpc.insecure_channel(fuzzed.target) as channel:
        stub = pb_grpc.HiCacheStub(channel)
        att = stub.Attach(pb.AttachRequest(engine_id="fz-probe", tp_size=1), metadata=auth_md(),
                          timeout=TIMEOUT_S)
        geometry = Geometry(att.page_size, {p.member: p.num_pages for p in att.pools}, att.lease_ms)
    page = geometry.page
    rng = random.Random(SEED)
    families = [tokens(16 * page, start=rng.randrange(1, 1 << 30)) for _ in range(5)]
    families += [families[0][: 4 * 3 * page] + tokens(8 * page, start=rng.randrange(1, 1 << 30))]

    fuzzer = Fuzzer(fuzzed, geometry, families)
    threads = [Thread(i, random.Random(SEED * 1000 + i),
                      ("fz0a", "fz0b") if SHARED else (f"fz{i}a", f"fz{i}b"))
               for i in range(THREADS)]
    names = [n for th in threads for n in (*th.names, f"fz{th.index}-ghost")]
    try:
        attach_all(fuzzer.stub, [n for th in threads for n in th.names], "inst")
        workers = [threading.Thread(target=fuzzer.run, args=(th, CALLS)) for th in threads]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        fuzz_s = time.monotonic() - started

        # Every handle of every engine the fuzz used goes (a new process attaches in its
        # place); nothing may stay locked, and the whole L1 can be allocated again.
        attach_all(fuzzer.stub, names, uuid.uuid4().hex)
        leak = after_fuzz_checks(fuzzed, fuzzer, geometry, log_from)
    finally:
        fuzzer.close()
    print(f"fuzz: {fuzzer.sent} requests in {fuzz_s:.1f} s ({THREADS} threads, seed {SEED})")
    print("fuzz: outcomes:", dict(sorted(fuzzer.outcomes.items())))
    failures = fuzzer.failures + leak
    distinct: dict[str, Failure] = {}
    for f in failures:
        distinct.setdefault(f"{f.what}|{f.call.split('(')[0]}|{f.detail[:60]}", f)
    assert not failures, f"{len(failures)} failures, {len(distinct)} distinct:\n" + "\n".join(
        str(f) for f in distinct.values())


def after_fuzz_checks(d: Daemon, fuzzer: Fuzzer, g: Geometry, log_from: int) -> list[Failure]:
    out: list[Failure] = []
    stub, md = fuzzer.stub, auth_md("fz-final")
    deadline = time.monotonic() + 10
    while True:  # running prefetches (their own pins) end within their timeout
        stats = stub.Stats(pb.StatsRequest(), metadata=md, timeout=TIMEOUT_S)
        locked = [(p.tier, p.member, p.locked_pages) for p in stats.pools if p.locked_pages]
        if not locked and not stats.counters.prefetches.running:
            break
        if time.monotonic() > deadline:
            out.append(Failure("leak", "Stats", f"locked pages with no handle held: {locked}; "
                                                f"prefetches running {stats.counters.prefetches.running}"))
            break
        time.sleep(0.1)

    stub.Attach(pb.AttachRequest(engine_id="fz-final", tp_size=1), metadata=auth_md(),
                timeout=TIMEOUT_S)
    capacity = next(p.capacity_pages for p in stats.pools if p.tier == pb.DEVICE and p.member == "full")
    first_error = None
    for attempt in range(30):  # (retried: a refusal that goes away is no leak)
        try:
            whole = stub.Allocate(pb.AllocateRequest(namespace="", num_tokens=capacity * g.page),
                                  metadata=md, timeout=TIMEOUT_S)
            stub.Release(pb.ReleaseRequest(allocation_id=whole.allocation_id), metadata=md,
                         timeout=TIMEOUT_S)
            if first_error is not None:  # (copies in flight: no leak; said, not failed)
                print(f"fuzz: the whole L1 was refused {attempt} times first: {first_error}")
            break
        except grpc.RpcError as e:
            first_error = first_error or f"{e.code().name}: {e.details()}"
            time.sleep(0.2)
    else:
        if os.environ.get("HICACHE_FUZZ_ON_LEAK"):  # (a hunt's aid: a command, given the pid)
            assert d.proc is not None
            subprocess.run(os.environ["HICACHE_FUZZ_ON_LEAK"].replace("PID", str(d.proc.pid)),
                           shell=True, timeout=120)
        stats = stub.Stats(pb.StatsRequest(), metadata=md, timeout=TIMEOUT_S)
        out.append(Failure("leak", "Allocate(the whole L1)", f"{first_error}; still after 6 s; "
                           f"stats: {str(stats).replace(chr(10), ' ')[:600]}"))

    # A normal request life: match (lock + allocation), write nothing, insert, match hits.
    prompt = tokens(2 * g.page, start=987_654_321)
    m = stub.MatchPrefix(pb.MatchPrefixRequest(tokens=prompt, lock=True, allocate_tokens=2 * g.page),
                         metadata=md, timeout=TIMEOUT_S)
    assert m.lock_id and m.allocation_id and m.device_tokens == 0
    ins = stub.Insert(pb.InsertRequest(tokens=prompt, lock_id=m.lock_id, allocation_id=m.allocation_id,
                                       mamba_checkpoint=True),  # (a MAMBA model reuses only there)
                      metadata=md, timeout=TIMEOUT_S)
    assert ins.inserted_tokens == 2 * g.page
    assert stub.MatchPrefix(pb.MatchPrefixRequest(tokens=prompt), metadata=md,
                            timeout=TIMEOUT_S).device_tokens == 2 * g.page
    hb = stub.Heartbeat(pb.HeartbeatRequest(engine_id="fz-final"), metadata=md, timeout=TIMEOUT_S)
    assert (hb.locks, hb.allocations) == (0, 0)

    health = health_pb2_grpc.HealthStub(fuzzer.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == \
        health_pb2.HealthCheckResponse.SERVING
    fuzzer.admin.Health(apb.HealthRequest(deep=True), metadata=md, timeout=TIMEOUT_S)
    counters = stub.Stats(pb.StatsRequest(), metadata=md, timeout=TIMEOUT_S).counters
    assert counters.lookups > 0
    print("fuzz: daemon counters:", str(counters).replace("\n", " "))
    assert d.proc is not None and d.proc.poll() is None
    log = d.log()[log_from:]
    for bad in ("Traceback", "failed unexpectedly"):
        if bad in log:
            at = log.index(bad)
            out.append(Failure("log", "daemon log", log[max(0, at - 300) : at + 2500]))
    return out


# ----------------------------------------------------------------------------- what the fuzz found


# Found by the fuzz: an error message quoting a long caller string (a session id) passed
# gRPC's metadata limit and the client got RESOURCE_EXHAUSTED instead of its status. Cut to
# 1,024 characters it still did for non-ASCII input (gRPC percent-encodes every UTF-8 byte:
# up to 12 bytes a character): messages are cut to 1,024 UTF-8 bytes. (ASCII: in
# tests/daemon/test_requests.py, with the other regression tests of this fuzz.)
def test_an_error_quoting_a_long_non_ascii_input_keeps_its_code(fuzzed: Daemon) -> None:
    with grpc.insecure_channel(fuzzed.target) as channel:
        stub = pb_grpc.HiCacheStub(channel)
        for _ in range(20):  # (between the soft and the hard limit, gRPC drops at random)
            with pytest.raises(grpc.RpcError) as info:
                stub.CloseSession(pb.CloseSessionRequest(session_id="🙂" * 1_024),  # (the longest)
                                  metadata=auth_md(), timeout=TIMEOUT_S)
            assert info.value.code() is C.NOT_FOUND, info.value.details()


# Found by the fuzz (a write_back hunt): once a leaf was evicted from L1 (written back to
# L2), its L1-only ancestors could never be evicted (FULL's candidate test refused the last
# copy of a node with children, and the write-back that would make another copy ran only
# for popped candidates): L1 pages lost for good with nothing locked or allocated.
def test_write_back_evicts_the_l1_only_ancestors_of_a_written_back_leaf(
        make_daemon: Callable[..., Daemon]) -> None:
    d = make_daemon("write.l1_to_l2=write_back")
    with d.client(engine_id="write-back", retries=0) as c:
        page = c.attach(map_pools=False).info.page_size
        capacity = next(p.capacity_pages for p in c.stats().pools if p.tier == "device")
        seq = tokens(7 * page, start=1_000)
        for n in (3, 6, 7):  # three nodes: pages [0, 3), [3, 6), [6, 7)
            m = c.match(seq[: 4 * n * page], lock=True, allocate_tokens=n * page)
            c.insert(seq[: 4 * n * page], lock_id=m.lock_id, allocation_id=m.allocation_id)
        # Room for 10 pages evicts the leaf [6, 7) (written back to L2), nothing else.
        c.release(allocation_id=c.allocate((capacity - 6) * page).allocation_id)
        whole = c.allocate(capacity * page)  # evicting (writing back) the other two makes room
        c.release(allocation_id=whole.allocation_id)


# Found by the fuzz: a request-streaming call (server reflection) whose client cancelled, or
# whose deadline passed, while the handler waited for its next message was logged "failed
# unexpectedly" with a traceback and counted INTERNAL (the request iterator raises
# grpc.RpcError; the interceptor handled GeneratorExit only).
def test_a_reflection_stream_whose_deadline_passes_logs_no_error(fuzzed: Daemon) -> None:
    from grpc_reflection.v1alpha import reflection_pb2

    log_from = len(fuzzed.log())
    with grpc.insecure_channel(fuzzed.target) as channel:
        call = channel.stream_stream(REFLECTION)
        for _ in range(6):  # (a race inside gRPC decides whether the handler sees an error)
            done = threading.Event()

            def requests(done: threading.Event = done) -> Iterator[bytes]:
                yield reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
                done.wait(5)  # the stream stays open past the deadline

            with pytest.raises(grpc.RpcError) as info:
                list(call(requests(), metadata=auth_md(), timeout=0.3))
            done.set()
            assert info.value.code() is C.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 2  # (the server notices, and logs, on its own thread)
    while time.monotonic() < deadline:
        assert "failed unexpectedly" not in fuzzed.log()[log_from:]
        time.sleep(0.1)
