"""Property-based fuzzing of the L3 backends (file, Redis, Mooncake) through their contract.

Random sessions of puts, gets, existence checks and deletes over a few odd keys (NUL,
'../', newlines, thousands of characters, ...), payloads of random sizes around the page
boundaries, reads into buffers of the wrong size, and above all a store that returns
junk: objects overwritten behind the backend's back (payload or header flipped, cut short,
appended to, another key's object, another format version, random bytes, empty values,
and for the file backend a directory, a FIFO or a link at the object's path; for Redis a
value of another type). Each step is checked against an oracle built here from the
documented header layout (integrity.py) and the failure model (base.py):

- a hit is never wrong bytes: the buffer holds exactly the stored object, whose header
  (checked fields) and payload checksum match its key;
- a corrupt object is CORRUPT with its buffer zeroed; it is removed from the store when it
  is one of ours (right size, cut short with our header, or shorter than a header) and left
  alone otherwise (another size, another format version, someone else's thing);
- nothing else in the store changes: every other key keeps its exact value;
- `exists_prefix` agrees with what the store holds, and the counters with the statuses;
- no call raises anything but the project's typed errors, with a message.

The bugs this hunt found are fixed; their regression tests are at the end.
Environment knobs for a longer hunt:

    HICACHE_FUZZ_EXAMPLES=2000   examples per property test (default 15)
    HICACHE_FUZZ_RANDOM=1        derandomize=False (a new seed each run)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
import signal
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
import xxhash
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from storage_pages import storage_config

from hicache.bench.services import MooncakeMaster, RedisServer
from hicache.config import FileStorageConfig
from hicache.errors import BackendUnavailable, HicacheError, InvalidArgument
from hicache.tiers.storage import (
    HEADER_BYTES,
    BackendStats,
    GetStatus,
    PutStatus,
    StorageBackend,
    build_backend,
)
from hicache.types import StorageBackendName

FUZZ = fuzz_settings(15)

# --------------------------------------------------------------------------- oracle

# The documented layout (integrity.py), rebuilt here rather than imported.
MAGIC = b"HKV\x01"
VERSION = 1
FIELDS = 40  # magic, version, reserved, payload length, checksum, key digest; then zero padding


def digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("ascii"), digest_size=16).digest()


def make_object(key: str, payload: bytes, *, version: int = VERSION, reserved: int = 0,
                length: int | None = None, magic: bytes = MAGIC) -> bytes:
    fields = struct.pack("<4sHHQQ16s", magic, version, reserved,
                         len(payload) if length is None else length,
                         xxhash.xxh3_64_intdigest(payload), digest(key))
    return fields + bytes(HEADER_BYTES - FIELDS) + payload


def valid(key: str, raw: bytes, nbytes: int) -> bool:
    """Whether `raw`, read into a buffer of `nbytes`, is `key`'s object (padding unchecked)."""
    return len(raw) == nbytes and raw[:FIELDS] == make_object(key, raw[HEADER_BYTES:])[:FIELDS]


def ours_and_broken(key: str, raw: bytes, nbytes: int) -> bool:
    """The failure model of base.py: which corrupt objects a reader with a buffer of
    `nbytes` must remove (ours: a right-sized one not in another format version, one cut
    short that still has our header for this key and size, one shorter than a header)."""
    if len(raw) < HEADER_BYTES:
        return True
    other_version = raw[:4] == MAGIC and struct.unpack_from("<H", raw, 4)[0] != VERSION
    if len(raw) == nbytes:
        return not other_version
    if len(raw) > nbytes:
        return False
    magic, version, _, length, _, key_digest = struct.unpack_from("<4sHHQQ16s", raw)
    return (magic == MAGIC and version == VERSION and length == nbytes - HEADER_BYTES
            and key_digest == digest(key))


@dataclass(frozen=True)
class Thing:
    """Something at a key's place that is no object (a directory, a FIFO, a link, a Redis
    list): CORRUPT to a reader, never removed by one."""

    kind: str
    present: bool  # what an existence check sees


Raw = bytes | Thing | None  # what the store holds under a key (None: nothing)


def present(raw: Raw) -> bool:
    return raw is not None and (not isinstance(raw, Thing) or raw.present)


# --------------------------------------------------------------------------- raw stores

class RawStore:
    """Direct access to what the backend stores, bypassing it (to plant junk)."""

    things: tuple[str, ...] = ()

    def write(self, key: str, value: bytes) -> bool:
        """Store `value` raw; False when this store cannot hold such a value."""
        raise NotImplementedError

    def thing(self, key: str, kind: str, other: str) -> Thing:
        raise NotImplementedError

    def read(self, key: str) -> Raw:
        raise NotImplementedError

    def remove(self, key: str) -> None:
        raise NotImplementedError


class FileRaw(RawStore):
    things = ("dir", "fifo", "link")

    def __init__(self, backend: StorageBackend) -> None:
        self.path_of: Callable[[str], str] = backend.path_of  # type: ignore[attr-defined]

    def _clear(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)

    def write(self, key: str, value: bytes) -> bool:
        path = self.path_of(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._clear(path)  # (never write through a link into another key's file)
        with open(path, "wb") as f:
            f.write(value)
        return True

    def thing(self, key: str, kind: str, other: str) -> Thing:
        path = self.path_of(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._clear(path)
        if kind == "dir":
            os.makedirs(os.path.join(path, "inner"))
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink(self.path_of(other), path)
        read = self.read(key)
        assert isinstance(read, Thing)
        return read

    def read(self, key: str) -> Raw:
        path = self.path_of(key)
        try:
            st_ = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(st_.st_mode):
            return Thing("dir", True)
        if stat.S_ISFIFO(st_.st_mode):
            return Thing("fifo", True)
        if stat.S_ISLNK(st_.st_mode):
            return Thing("link", os.path.exists(path))
        with open(path, "rb") as f:
            return f.read()

    def remove(self, key: str) -> None:
        self._clear(self.path_of(key))


class RedisRaw(RawStore):
    things = ("wrongtype",)

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def write(self, key: str, value: bytes) -> bool:
        self.client.set(key, value)
        return True

    def thing(self, key: str, kind: str, other: str) -> Thing:
        self.client.delete(key)
        self.client.rpush(key, b"someone else's list")
        return Thing("wrongtype", True)

    def read(self, key: str) -> Raw:
        kind = self.client.type(key)
        if kind == b"none":
            return None
        if kind != b"string":
            return Thing("wrongtype", True)
        value = self.client.get(key)
        assert value is None or isinstance(value, bytes)
        return value

    def remove(self, key: str) -> None:
        self.client.delete(key)


class MooncakeRaw(RawStore):
    """The backend's own client, used directly (a second client costs seconds to close)."""

    def __init__(self, raw: StorageBackend) -> None:
        self.store: Any = raw.store  # type: ignore[attr-defined]

    def write(self, key: str, value: bytes) -> bool:
        if not value:
            return False  # (upsert of 0 bytes: -600 INVALID_PARAMS; no empty objects here)
        rc = self.store.upsert(key, value)
        assert rc == 0, f"upsert({key!r}) = {rc}"
        return True

    def read(self, key: str) -> Raw:
        if self.store.is_exist(key) != 1:
            return None
        return bytes(self.store.get(key))

    def remove(self, key: str) -> None:
        self.store.batch_remove([key], True)


# --------------------------------------------------------------------------- fixtures

ARENA_BYTES = 4 << 20


@dataclass
class L3:
    kind: str
    backend: StorageBackend
    raw: RawStore
    arena: np.ndarray  # registered with the backend: every buffer is carved from it


def _arena() -> np.ndarray:
    raw = np.zeros(ARENA_BYTES + 4096, dtype=np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip : skip + ARENA_BYTES]


@pytest.fixture(scope="module", params=["file", "file-threads", "redis", "redis-ttl", "mooncake"])
def l3(request: pytest.FixtureRequest,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[L3]:
    kind = request.param
    raw: RawStore
    if kind.startswith("file"):
        # file-threads: calls spread over threads (`storage.file.threads: 4`)
        root = tmp_path_factory.mktemp("l3fuzz")
        threads = 4 if kind == "file-threads" else None
        backend = build_backend(storage_config(
            StorageBackendName.FILE, file=FileStorageConfig(path=str(root), threads=threads)))
        raw = FileRaw(backend)
    elif kind.startswith("redis"):
        # redis-ttl: reads renew a TTL (GETEX), batches of 3 keys
        server: RedisServer = request.getfixturevalue("redis_server")
        cfg = storage_config(StorageBackendName.REDIS, redis_url=server.url,
                             redis_batch=3 if kind == "redis-ttl" else 8)
        if kind == "redis-ttl":
            cfg = dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, ttl_s=3600))
        backend = build_backend(cfg)
        raw = RedisRaw(server.url)
    else:
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        cfg = storage_config(StorageBackendName.MOONCAKE, mooncake_master=master.master,
                             mooncake_metadata=master.metadata_server)
        backend = build_backend(cfg)
        raw = MooncakeRaw(backend)
    arena = _arena()
    backend.register_host_buffer(arena.ctypes.data, arena.nbytes)
    yield L3(kind, backend, raw, arena)
    backend.unregister_host_buffer(arena.ctypes.data)
    backend.close()


class Carver:
    """Buffers carved one after another from the arena, at odd offsets too."""

    def __init__(self, arena: np.ndarray, rng: random.Random) -> None:
        self.arena, self.rng, self.at = arena, rng, 0

    def take(self, nbytes: int) -> np.ndarray:
        self.at += self.rng.choice([0, 0, 1, 3, 8, 64])  # (misaligned starts as well)
        assert self.at + nbytes <= self.arena.nbytes, "arena too small for this batch"
        buf = self.arena[self.at : self.at + nbytes]
        self.at += nbytes
        return buf


# --------------------------------------------------------------------------- strategies

ODD_KEYS = st.one_of(
    st.sampled_from(["../", "../../etc/passwd", "/", "./.", "a/../b", "\x00", "a\x00b",
                     "\n", " ", "\x7f", "%s%n", "*", "?[a]{x}", "\\", "ns:x/model/f16/ab:full"]),
    st.text(alphabet=st.characters(max_codepoint=127), max_size=30),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "/", "\x00", ".", "../"]),
              st.integers(300, 3000)),
)
# Payload bytes: around the header, 4 KiB pages and their headers, and anything up to 12 KB.
PAYLOADS = st.one_of(
    st.sampled_from([1, 2, 39, 40, 63, 64, 65, 4031, 4032, 4033, 4095, 4096, 4097, 8192,
                     65535, 65536, 65537]),
    st.integers(1, 12000),
)
JUNK = ("flip", "truncate", "random", "other_key", "empty", "other_version", "other_size",
        "field", "pad", "append", "vanish", "thing")
SEED = st.integers(0, 2**32 - 1)


def operations(n: int) -> st.SearchStrategy[tuple[Any, ...]]:
    key = st.integers(0, n - 1)
    return st.one_of(
        st.tuples(st.just("put"), st.lists(st.tuples(key, PAYLOADS), min_size=1, max_size=6), SEED),
        # (None: a buffer the size of the stored object, so that most reads can hit)
        st.tuples(st.just("get"), st.lists(st.tuples(key, st.one_of(st.none(), st.none(), PAYLOADS)),
                                           min_size=1, max_size=6), SEED),
        st.tuples(st.just("exists"), st.lists(key, max_size=6)),
        st.tuples(st.just("delete"), st.lists(key, max_size=4)),
        st.tuples(st.just("junk"), key, st.sampled_from(JUNK), SEED),
        st.tuples(st.just("junk"), key, st.sampled_from(JUNK), SEED),
        st.tuples(st.just("bulk"), st.integers(60, 150), SEED),
    )


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[str], list[tuple[Any, ...]]]:
    odd = draw(st.lists(ODD_KEYS, min_size=1, max_size=5, unique=True))
    # Everything stored first (most junk then lands on an object of ours), then the ops.
    prelude = ("put", [(i, draw(PAYLOADS)) for i in range(len(odd))], draw(SEED))
    ops = draw(st.lists(operations(len(odd)), min_size=1, max_size=12))
    return odd, [prelude, *ops]


# --------------------------------------------------------------------------- the session

def _counter_delta(before: BackendStats, after: BackendStats) -> dict[str, int]:
    return {name: int(getattr(after, name)) - int(getattr(before, name))
            for name in ("gets", "hits", "misses", "corrupt", "corrupt_removed", "puts",
                         "stored", "present", "put_failed", "deleted", "unavailable")}


class Session:
    def __init__(self, l3: L3, keys: list[str]) -> None:
        self.l3, self.backend, self.raw = l3, l3.backend, l3.raw
        self.keys = keys
        self.model: dict[str, Raw] = {key: None for key in keys}

    # -- junk ---------------------------------------------------------------------------

    def junk(self, i: int, kind: str, seed: int) -> None:
        rng = random.Random(seed)
        key = self.keys[i]
        current = self.model[key]
        if isinstance(current, bytes) and len(current) > HEADER_BYTES:
            base = current
        else:
            base = make_object(key, rng.randbytes(rng.choice([1, 100, 4096])))
        value: bytes
        if kind == "thing" and self.raw.things:
            other = self.keys[rng.randrange(len(self.keys))]
            self.model[key] = self.raw.thing(key, rng.choice(self.raw.things), other)
            self._refresh_links()
            return
        if kind == "vanish":
            self.raw.remove(key)
            self.model[key] = None
            self._refresh_links()
            return
        if kind == "flip":  # a checked header field or a payload byte
            spots = [*range(FIELDS), *range(HEADER_BYTES, len(base))]
            pos = rng.choice(spots)
            flipped = bytearray(base)
            flipped[pos] ^= 1 << rng.randrange(8)
            value = bytes(flipped)
        elif kind == "truncate":
            value = base[: rng.randrange(len(base))]
        elif kind == "random" or kind == "thing":
            value = rng.randbytes(rng.choice([0, 1, 39, 40, 63, 64, 65, len(base),
                                              rng.randrange(1, 9000)]))
        elif kind == "other_key":
            other = rng.choice([k for k in self.keys if k != key] or [key + "'"])
            size = rng.choice([len(base) - HEADER_BYTES, rng.randrange(1, 9000)])
            value = make_object(other, rng.randbytes(size))
        elif kind == "empty":
            value = b""
        elif kind == "other_version":
            value = make_object(key, base[HEADER_BYTES:], version=rng.choice([0, 2, 0xFFFF]))
        elif kind == "other_size":  # a good object of this key, another geometry
            value = make_object(key, rng.randbytes(rng.randrange(1, 9000)))
        elif kind == "field":
            payload = base[HEADER_BYTES:]
            value = rng.choice([
                make_object(key, payload, reserved=rng.randrange(1, 0x10000)),
                make_object(key, payload, length=rng.choice([0, len(payload) + 1, 2**63])),
                make_object(key, payload, magic=rng.choice([b"HKV\x00", b"\x00" * 4, b"HKV\x02"])),
            ])
        elif kind == "pad":  # junk in the header padding (unchecked by design)
            padded = bytearray(base)
            padded[FIELDS:HEADER_BYTES] = rng.randbytes(HEADER_BYTES - FIELDS)
            value = bytes(padded)
        else:  # "append"
            value = base + rng.randbytes(rng.choice([1, 63, 4096]))
        if self.raw.write(key, value):
            self.model[key] = value
            self._refresh_links()

    def _refresh_links(self) -> None:
        """A link's presence follows its target (file backend only)."""
        for key, raw in self.model.items():
            if isinstance(raw, Thing) and raw.kind == "link":
                self.model[key] = self.raw.read(key)

    # -- operations ---------------------------------------------------------------------

    def put(self, entries: list[tuple[int, int]], seed: int) -> None:
        rng = random.Random(seed)
        carve = Carver(self.l3.arena, rng)
        keys = [self.keys[i] for i, _ in entries]
        bufs = [carve.take(HEADER_BYTES + n) for _, n in entries]
        for buf in bufs:
            buf[:] = np.frombuffer(rng.randbytes(buf.nbytes), dtype=np.uint8)
        payloads = [bytes(buf[HEADER_BYTES:]) for buf in bufs]
        before = self.backend.stats()
        out = self.backend.put_from(keys, bufs)
        want: list[PutStatus] = []
        first: dict[str, int] = {}
        for j, key in enumerate(keys):
            if key in first:
                want.append(PutStatus.PRESENT)
                continue
            first[key] = j
            if present(self.model[key]) and not self._torn(key, self.model[key], bufs[j].nbytes):
                want.append(PutStatus.PRESENT)
            else:
                want.append(PutStatus.STORED)
                self.model[key] = make_object(key, payloads[j])
        assert out == want, (keys, out, want)
        for j in first.values():  # the header was written, the payload left alone
            assert bytes(bufs[j]) == make_object(keys[j], payloads[j])
        self._refresh_links()
        delta = _counter_delta(before, self.backend.stats())
        assert delta["puts"] == len(keys)
        assert delta["stored"] == want.count(PutStatus.STORED)
        assert delta["present"] == want.count(PutStatus.PRESENT)

    def _torn(self, key: str, raw: Raw, nbytes: int) -> bool:
        """Whether the file backend writes a put of `nbytes` over `raw` (our object of
        `key` cut short, or shorter than any header: a writer died without fsync)."""
        return (self.l3.kind.startswith("file") and isinstance(raw, bytes) and len(raw) < nbytes
                and ours_and_broken(key, raw, nbytes))

    def get(self, entries: list[tuple[int, int | None]], seed: int) -> None:
        rng = random.Random(seed)
        carve = Carver(self.l3.arena, rng)
        keys = [self.keys[i] for i, _ in entries]
        sizes = []
        for key, n in zip(keys, (n for _, n in entries), strict=True):
            raw = self.model[key]
            if n is None:
                sizes.append(len(raw) if isinstance(raw, bytes) and len(raw) > HEADER_BYTES
                             else HEADER_BYTES + 4096)
            else:
                sizes.append(HEADER_BYTES + n)
        bufs = [carve.take(n) for n in sizes]
        for buf in bufs:  # stale bytes that must never pass for an object
            buf[:] = np.frombuffer(rng.randbytes(buf.nbytes), dtype=np.uint8)
        before = self.backend.stats()
        out = self.backend.get_into(keys, bufs)
        assert len(out) == len(keys)
        removed: set[str] = set()
        for key, buf, status in zip(keys, bufs, out, strict=True):
            raw = self.model[key]
            if raw is None:
                assert status is GetStatus.MISS, (key, status)
            elif isinstance(raw, bytes) and valid(key, raw, buf.nbytes):
                assert status is GetStatus.HIT, (key, status, len(raw), buf.nbytes)
                assert bytes(buf) == raw, f"{key!r}: a hit with other bytes than stored"
            else:
                assert status is GetStatus.CORRUPT, (key, status, raw if isinstance(raw, Thing)
                                                     else (len(raw), raw[:FIELDS]), buf.nbytes)
                assert not buf.any(), f"{key!r}: a corrupt object's buffer was not zeroed"
                if isinstance(raw, bytes) and ours_and_broken(key, raw, buf.nbytes):
                    removed.add(key)
        for key in removed:
            self.model[key] = None
        self._refresh_links()
        delta = _counter_delta(before, self.backend.stats())
        assert delta["gets"] == len(keys)
        assert delta["hits"] == out.count(GetStatus.HIT)
        assert delta["misses"] == out.count(GetStatus.MISS)
        assert delta["corrupt"] == out.count(GetStatus.CORRUPT)
        assert delta["corrupt_removed"] == len(removed)

    def exists(self, idx: list[int]) -> None:
        keys = [self.keys[i] for i in idx]
        run = 0
        for key in keys:
            if not present(self.model[key]):
                break
            run += 1
        assert self.backend.exists_prefix(keys) == run

    def delete(self, idx: list[int]) -> None:
        # NOTE: a directory at a key's file is left out here: see
        # test_file_delete_of_a_key_whose_path_is_a_directory_is_not_unavailable.
        keys = [self.keys[i] for i in idx
                if not (isinstance(self.model[self.keys[i]], Thing)
                        and self.model[self.keys[i]].kind == "dir")]  # type: ignore[union-attr]
        unique = list(dict.fromkeys(keys))
        # (a dangling link is no object, but it is at the key's place, and delete takes it)
        want = sum(1 for key in unique if self.model[key] is not None)
        assert self.backend.delete(keys) == want
        for key in unique:
            self.model[key] = None
        self._refresh_links()

    def bulk(self, n: int, seed: int) -> None:
        """More keys than a pipeline chunk (64) or a Redis batch: stored, some made junk,
        read back, checked and deleted through the same steps as the others."""
        rng = random.Random(seed)
        lo = len(self.keys)
        tag = f"{self.keys[0]}/bulk{lo}"  # (unique: the universe only grows)
        for j in range(n):
            key = f"{tag}/{j}"
            self.keys.append(key)
            self.model[key] = None
        idx = list(range(lo, lo + n))
        self.put([(i, rng.randrange(1, 300)) for i in idx], rng.randrange(2**32))
        for i in rng.sample(idx, n // 5):
            self.junk(i, rng.choice(JUNK), rng.randrange(2**32))
        self.get([(i, None) for i in idx], rng.randrange(2**32))
        self.exists(idx)
        self.check_store()
        self.delete(idx)

    def check_store(self) -> None:
        """Every key holds exactly what the oracle says (nothing lost, nothing altered)."""
        for key, want in self.model.items():
            got = self.raw.read(key)
            assert got == want, (key, "store holds", _short(got), "expected", _short(want))
        assert self.backend.stats().stuck_calls == 0

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        try:
            for op in ops:
                try:
                    getattr(self, op[0])(*op[1:])
                except HicacheError as e:
                    pytest.fail(f"{op[0]} raised {type(e).__name__}: {e}")
                self.check_store()
        finally:
            for key in self.keys:
                self.raw.remove(key)


def _short(raw: Raw) -> object:
    return raw if not isinstance(raw, bytes) else (len(raw), raw[:FIELDS])


@FUZZ
@given(session=sessions())
def test_random_sessions_over_a_store_full_of_junk(l3: L3, session: tuple[list[str], list[Any]]) -> None:
    odd, ops = session
    ns = uuid.uuid4().hex[:12]
    Session(l3, [f"{k}#{ns}" for k in odd]).run(ops)


# --------------------------------------------------------------------------- bad arguments

BAD_KEYS = ["", "caf\u00e9", "\u043a\u043b\u044e\u0447", "\udcff", "\x00\u00ff",
            b"bytes-key", 7, None]


def _bad_buffer(kind: str, arena: np.ndarray) -> Any:
    at = 1 << 20
    if kind == "int8":
        return arena[at : at + 4160].view(np.int8)
    if kind == "float":
        return arena[at : at + 4160].view(np.float32)
    if kind == "2d":
        return arena[at : at + 8320].reshape(2, 4160)
    if kind == "strided":
        return arena[at : at + 8320 : 2]
    if kind == "reversed":
        return arena[at : at + 4160][::-1]
    if kind == "header-only":  # payload 0
        return arena[at : at + HEADER_BYTES]
    if kind == "tiny":
        return arena[at : at + 10]
    if kind == "empty":
        return arena[at:at]
    if kind == "bytes":
        return bytes(4160)
    if kind == "bytearray":
        return bytearray(4160)
    return list(range(10))


BAD_BUFFERS = ["int8", "float", "2d", "strided", "reversed", "header-only", "tiny", "empty",
               "bytes", "bytearray", "list"]


@FUZZ
@given(n=st.integers(1, 4), at=st.integers(0, 3), bad_key=st.sampled_from(BAD_KEYS),
       bad_buf=st.sampled_from([*BAD_BUFFERS, "count"]), which=st.sampled_from(["key", "buffer"]),
       op=st.sampled_from(["put", "get", "exists", "delete"]))
def test_bad_arguments_are_invalid_argument_and_touch_nothing(
    l3: L3, n: int, at: int, bad_key: Any, bad_buf: str, which: str, op: str
) -> None:
    ns = uuid.uuid4().hex[:12]
    sentinel = f"sentinel#{ns}"
    carve = Carver(l3.arena, random.Random(n))
    good = carve.take(HEADER_BYTES + 100)
    good[HEADER_BYTES:] = 7
    assert l3.backend.put_from([sentinel], [good]) == [PutStatus.STORED]
    stored = l3.raw.read(sentinel)
    keys: list[Any] = [f"k{j}#{ns}" for j in range(n)]
    bufs: list[Any] = [carve.take(HEADER_BYTES + 100) for _ in range(n)]
    for buf in bufs:
        buf[:] = 0xAB
    at = min(at, n - 1)
    if which == "key" or op in ("exists", "delete"):
        keys[at] = bad_key
    elif bad_buf == "count":
        bufs.pop()
    else:
        bufs[at] = _bad_buffer(bad_buf, l3.arena)
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: l3.backend.put_from(keys, bufs),
        "get": lambda: l3.backend.get_into([*keys, sentinel], [*bufs, good]),
        "exists": lambda: l3.backend.exists_prefix(keys),
        "delete": lambda: l3.backend.delete([*keys, sentinel]),
    }
    with pytest.raises(InvalidArgument) as e:
        calls[op]()
    assert str(e.value)
    for buf in bufs:  # neither a header nor a read landed in any buffer
        if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.nbytes == HEADER_BYTES + 100:
            assert (buf == 0xAB).all()
    good_keys = [k for k in keys if isinstance(k, str) and k and k.isascii()]
    assert l3.backend.exists_prefix(good_keys) == 0
    assert l3.raw.read(sentinel) == stored
    l3.raw.remove(sentinel)


# --------------------------------------------------------------------------- odd keys, big

@pytest.mark.parametrize("key", ["x" * 100_000, "/" * 4096, "../" * 2000, "\x00" * 1000])
def test_very_long_and_path_like_keys_round_trip(l3: L3, key: str) -> None:
    carve = Carver(l3.arena, random.Random(0))
    src, dst = carve.take(HEADER_BYTES + 4096), carve.take(HEADER_BYTES + 4096)
    src[HEADER_BYTES:] = np.arange(4096) % 251
    assert l3.backend.put_from([key], [src]) == [PutStatus.STORED]
    try:
        assert l3.backend.exists_prefix([key, key + "?"]) == 1
        assert l3.backend.get_into([key], [dst]) == [GetStatus.HIT]
        assert bytes(dst) == bytes(src) == l3.raw.read(key)
        assert l3.backend.get_into([key[:-1] or "?"], [dst]) in ([GetStatus.MISS],)
    finally:
        assert l3.backend.delete([key]) == 1


# --------------------------------------------------------------------------- faults

TIMEOUT_S = 0.5
SLACK_S = 2.0


def _fails_clearly_and_fast(fn: Callable[[], object]) -> BackendUnavailable:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as e:
        fn()
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert "redis" in str(e.value)
    return e.value


@pytest.mark.parametrize("stop_after", [1, 3])
def test_redis_stopped_mid_sequence_fails_clearly_then_recovers(
    redis_factory: Callable[[], RedisServer], stop_after: int
) -> None:
    """Killed after `stop_after` steps: every call raises a BackendUnavailable that names
    Redis within storage.timeout_s, never hangs, never a hit of wrong bytes; after the
    restart (an empty server: no persistence) calls work again and old keys are misses."""
    server = redis_factory()
    backend = build_backend(storage_config(StorageBackendName.REDIS, timeout_s=TIMEOUT_S,
                                           redis_url=server.url))
    arena = _arena()
    carve = Carver(arena, random.Random(stop_after))
    keys = [f"k{i}#{uuid.uuid4().hex[:8]}" for i in range(6)]
    src = [carve.take(HEADER_BYTES + 4096) for _ in keys]
    dst = [carve.take(HEADER_BYTES + 4096) for _ in keys]
    for i, buf in enumerate(src):
        buf[HEADER_BYTES:] = i + 1
    steps: list[Callable[[], object]] = [
        lambda: backend.put_from(keys[:2], src[:2]),
        lambda: backend.exists_prefix(keys),
        lambda: backend.get_into(keys[:3], dst[:3]),
        lambda: backend.put_from(keys[2:], src[2:]),
        lambda: backend.delete(keys[5:]),
    ]
    try:
        for step in steps[:stop_after]:
            step()
        server.stop(kill=True)
        for step in steps[stop_after:] + steps[:stop_after]:
            _fails_clearly_and_fast(step)
        assert not backend.health().healthy
        server.start()
        deadline = time.monotonic() + 5.0
        while True:
            try:
                statuses = backend.get_into(keys, dst)
                break
            except BackendUnavailable:
                assert time.monotonic() < deadline, "redis did not recover within 5 s"
                time.sleep(0.1)
        assert statuses == [GetStatus.MISS] * len(keys)
        assert backend.put_from(keys, src) == [PutStatus.STORED] * len(keys)
        assert backend.get_into(keys, dst) == [GetStatus.HIT] * len(keys)
        assert all(bytes(d) == bytes(s) for d, s in zip(dst, src, strict=True))
        assert backend.stats().stuck_calls == 0
    finally:
        backend.close()


def test_redis_that_hangs_mid_batch_fails_fast_while_stuck_then_recovers(
    redis_factory: Callable[[], RedisServer],
) -> None:
    server = redis_factory()
    backend = build_backend(storage_config(StorageBackendName.REDIS, timeout_s=TIMEOUT_S,
                                           redis_url=server.url))
    carve = Carver(_arena(), random.Random(1))
    keys = [f"h{i}#{uuid.uuid4().hex[:8]}" for i in range(3)]
    bufs = [carve.take(HEADER_BYTES + 512) for _ in keys]
    assert backend.put_from(keys, bufs) == [PutStatus.STORED] * 3
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        _fails_clearly_and_fast(lambda: backend.get_into(keys, bufs))
        # Fails fast while that call is stuck (or, when redis-py's own socket timeout,
        # equal to the bound, ended it first, times out itself): never waits longer.
        _fails_clearly_and_fast(lambda: backend.exists_prefix(keys))
    finally:
        os.kill(server.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    while backend.stats().stuck_calls:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert backend.get_into(keys, bufs) == [GetStatus.HIT] * 3
    backend.close()


# --------------------------------------------------------------------------- threads

def test_threads_racing_on_the_same_keys_never_see_wrong_bytes(l3: L3) -> None:
    """Every public method may be called from several threads at once: puts, gets and
    deletes of the same keys (same key, same bytes) give hits of exactly those bytes or
    misses, never a corrupt object (whose removal would lose a good copy) or an error."""
    ns = uuid.uuid4().hex[:12]
    keys = [f"race{i}#{ns}" for i in range(12)]
    payloads = [bytes([i + 1]) * 700 for i in range(len(keys))]
    errors: list[str] = []
    before = l3.backend.stats()

    def worker(t: int) -> None:
        rng = random.Random(t)
        region = l3.arena[t * (256 << 10) : (t + 1) * (256 << 10)]
        carve = Carver(region, rng)
        bufs = [carve.take(HEADER_BYTES + 700) for _ in keys]
        try:
            for _ in range(25):
                idx = sorted(rng.sample(range(len(keys)), rng.randrange(1, 6)))
                ks, bs = [keys[i] for i in idx], [bufs[i] for i in idx]
                op = rng.randrange(4)
                if op < 2:
                    for i in idx:
                        bufs[i][HEADER_BYTES:] = np.frombuffer(payloads[i], dtype=np.uint8)
                    l3.backend.put_from(ks, bs)
                elif op == 2:
                    for i, status in zip(idx, l3.backend.get_into(ks, bs), strict=True):
                        if status is GetStatus.HIT:
                            if bytes(bufs[i][HEADER_BYTES:]) != payloads[i]:
                                errors.append(f"{keys[i]}: a hit with wrong bytes")
                        elif status is not GetStatus.MISS:
                            errors.append(f"{keys[i]}: {status}")
                else:
                    l3.backend.exists_prefix(ks)
                    if rng.random() < 0.3:
                        l3.backend.delete(ks[:1])
        except Exception as e:  # (reported below, with the others)
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    l3.backend.delete(keys)
    assert not errors, errors[:5]
    delta = _counter_delta(before, l3.backend.stats())
    assert delta["corrupt"] == 0 and delta["unavailable"] == 0


# --------------------------------------------------------------------------- bugs found

def _read_only(buf: np.ndarray) -> np.ndarray:
    view = buf.view()
    view.flags.writeable = False
    return view


def test_put_from_a_read_only_buffer_is_invalid_argument(l3: L3) -> None:
    carve = Carver(l3.arena, random.Random(0))
    key = f"ro-put#{uuid.uuid4().hex[:12]}"
    with pytest.raises(InvalidArgument):
        l3.backend.put_from([key], [_read_only(carve.take(HEADER_BYTES + 4096))])


def test_get_into_a_read_only_buffer_is_invalid_argument(l3: L3) -> None:
    carve = Carver(l3.arena, random.Random(0))
    key = f"ro-get#{uuid.uuid4().hex[:12]}"
    src, dst = carve.take(HEADER_BYTES + 4096), carve.take(HEADER_BYTES + 4096)
    src[HEADER_BYTES:] = 1
    dst[:] = 0
    assert l3.backend.put_from([key], [src]) == [PutStatus.STORED]
    try:
        with pytest.raises(InvalidArgument):
            l3.backend.get_into([key], [_read_only(dst)])
        assert not dst.any()  # (Mooncake wrote the object into the read-only buffer)
    finally:
        l3.backend.delete([key])


def _file_backend(tmp_path: os.PathLike[str]) -> StorageBackend:
    return build_backend(storage_config(StorageBackendName.FILE,
                                        file=FileStorageConfig(path=str(tmp_path))))


def _keys_in_distinct_fanout_folders(backend: StorageBackend, n: int) -> list[str]:
    keys: list[str] = []
    folders: set[str] = set()
    for i in range(1000):
        key = f"fan{i}"
        folder = os.path.dirname(os.path.dirname(backend.path_of(key)))  # type: ignore[attr-defined]
        if folder not in folders:
            folders.add(folder)
            keys.append(key)
        if len(keys) == n:
            return keys
    raise AssertionError("no keys in distinct folders")


def test_file_junk_at_a_fanout_folder_costs_only_its_own_keys(tmp_path: os.PathLike[str]) -> None:
    backend = _file_backend(tmp_path)
    try:
        a, victim, b = _keys_in_distinct_fanout_folders(backend, 3)
        carve = Carver(_arena(), random.Random(0))
        src = [carve.take(HEADER_BYTES + 4096) for _ in range(3)]
        dst = [carve.take(HEADER_BYTES + 4096) for _ in range(3)]
        assert backend.put_from([a, b], [src[0], src[2]]) == [PutStatus.STORED] * 2
        folder = os.path.dirname(os.path.dirname(backend.path_of(victim)))  # type: ignore[attr-defined]
        with open(folder, "wb") as f:  # someone else's file where the folder would go
            f.write(b"not a folder")
        assert backend.exists_prefix([a, victim, b]) == 1
        got = backend.get_into([a, victim, b], dst)  # raised BackendUnavailable (ENOTDIR)
        assert got[0] is GetStatus.HIT and got[2] is GetStatus.HIT
        assert got[1] in (GetStatus.MISS, GetStatus.CORRUPT)
        put = backend.put_from([victim, a], [src[1], src[0]])  # raised too
        assert put == [PutStatus.FAILED, PutStatus.PRESENT]
    finally:
        backend.close()


def test_file_delete_of_a_key_whose_path_is_a_directory_is_not_unavailable(
    tmp_path: os.PathLike[str],
) -> None:
    backend = _file_backend(tmp_path)
    try:
        a, odd, b = (f"del-{name}" for name in ("a", "odd", "b"))
        carve = Carver(_arena(), random.Random(0))
        assert backend.put_from([a, b], [carve.take(HEADER_BYTES + 100) for _ in range(2)]) == [
            PutStatus.STORED] * 2
        path = backend.path_of(odd)  # type: ignore[attr-defined]
        os.makedirs(os.path.join(path, "inner"))  # someone else's directory at the object's path
        assert backend.exists_prefix([odd]) == 1
        assert backend.get_into([odd], [carve.take(HEADER_BYTES + 100)]) == [GetStatus.CORRUPT]
        removed = backend.delete([a, odd, b])  # raised BackendUnavailable, b left behind
        assert removed in (2, 3)
        assert backend.exists_prefix([a]) == 0 and backend.exists_prefix([b]) == 0
    finally:
        backend.close()


@pytest.mark.parametrize("junk", ["pid-too-large", "pid-in-other-digits", "symlink-loop"])
def test_file_start_over_junk_left_in_the_store_folder(tmp_path: os.PathLike[str], junk: str) -> None:
    """Another node's (or anyone's) leftovers in a shared store folder: a temp-like name of
    this host whose pid field is no usable pid, or a link that points at itself."""
    from hicache.tiers.storage.file import _host_tag

    root = str(tmp_path)
    if junk == "symlink-loop":
        path = os.path.join(root, "loop.kv")
        os.symlink("loop.kv", path)
    else:
        pid = "9" * 30 if junk == "pid-too-large" else "\u00b2\u00b3"  # (str.isdigit() is True)
        h = "0123456789abcdef" * 2  # (where this code writes an object's temp file)
        os.makedirs(os.path.join(root, h[:2], h[2:4]))
        path = os.path.join(root, h[:2], h[2:4], f"{h}.kv.{_host_tag()}.{pid}.1.tmp")
        with open(path, "wb"):
            pass
    backend = _file_backend(tmp_path)
    try:
        assert backend.wait_indexed(10)  # (the start's walk runs in the background)
        # A temp file of this host whose pid is past any process's is a dead writer's
        # (removed); a name this code does not write, and a link, are left alone.
        assert os.path.lexists(path) == (junk != "pid-too-large")
        assert backend.used_bytes == 0  # (none of it indexed as an object)
    finally:
        backend.close()
