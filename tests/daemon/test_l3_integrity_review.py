"""Review: what comes back from L3 is never wrong bytes.

Daemons (or in-process controllers, "nodes") sharing one L3 but configured with another
model geometry never serve each other's pages; objects in L3 that are truncated, too long,
empty, overwritten with junk or replaced by something that is no object at all come back
as a miss with a counted failure, never as wrong KV in L1 and never as a crash, and what
L1 already held stays as it was; `hicache health --deep` judges the store, not its junk.

The daemon tests run real `hicache serve` processes on a file store (and a private
redis-server for the Redis cases, in process); engines write KV with a pattern of their
own (`Oracle`) and check every reused page byte for byte through the mapped pools.
Tests marked xfail(strict) pin bugs found in this review.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from hicache.bench.oracle import KvOracle
from hicache.client import Client
from hicache.config import load_config
from hicache.controller.base import L3Op, MatchRequest, PrefetchState
from hicache.keys import CANARY_PREFIX, chain_hashes, chain_seed, split_hashes, storage_key
from hicache.tiers.storage import base as storage_base
from hicache.tiers.storage.integrity import HEADER_BYTES, key_digest
from hicache.types import ComponentKind, Tier

from .daemonkit import PAGE, Daemon, free_port, run_cli, scrape, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from engine_sim import Engine, built_controllers, evict_all, seq, wait_prefetch

MakeDaemon = Callable[..., Daemon]
FULL = ComponentKind.FULL
PAGES = 6  # 384 tokens: above the prefetch threshold (256), within L1 (16 pages)
BAD = 3  # the page whose object is junk: pages 0..2 still come from L3
WRITE_THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through",
                 "prefetch.policy=wait_complete")


# ------------------------------------------------------------------------- helpers


class Oracle(KvOracle):
    """`KvOracle` whose KV also depends on `tag` (the writing daemon's model): a page
    another model wrote reads as wrong bytes here, not as the same pattern."""

    def __init__(self, att: Any, namespace: str, tag: str) -> None:
        super().__init__(att.info, att.pools, namespace)
        self.seed = chain_seed(namespace, f"oracle-{tag}", "", "")


def _file_sets(root: Path, *extra: str) -> tuple[str, ...]:
    return (*WRITE_THROUGH, "storage.backend=file", f"storage.file.path={root}",
            "storage.required=true", *extra)


def _object_path(root: Path, key: str) -> Path:
    h = key_digest(key).hex()
    return root / h[0:2] / h[2:4] / f"{h}.kv"


def _page_keys(d: Daemon, prompt: bytes, namespace: str, member: str = "full") -> list[str]:
    """The L3 keys `d` uses for each whole page of `prompt` (one member)."""
    model = load_config(None, d.sets).model
    blob = chain_hashes(model.chain_seed(namespace), prompt, model.page_size * 4)
    return [storage_key(namespace, model.id, h, member) for h in split_hashes(blob)]


def _wait_prefetch(c: Client, prefetch_id: int, timeout_s: float = 15.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while (state := c.prefetch_status(prefetch_id).state) is PrefetchState.RUNNING:
        assert time.monotonic() < deadline, "prefetch still running"
        time.sleep(0.02)
    return state


def _write_prompt(c: Client, oracle: Oracle, prompt: bytes, namespace: str) -> None:
    m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4)
    assert m.device_tokens == 0
    oracle.write(prompt, m.pages, start_page=0)
    c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)


def _metric(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _corrupt_found(port: int) -> float:
    return _metric(scrape(port), "hicache_l3_corrupt_objects_total", 'action="found",backend="file"')


# Junk planted at one page's object, each as another writer could leave it. `removed`:
# whether the reader takes it out of the store (an object of ours, broken) or leaves it
# (not ours to judge: another size or format version, or no object at all).
def _zero(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(b"")


def _torn(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(good[: len(good) // 2])


def _short_junk(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(np.random.default_rng(1).integers(0, 256, len(good) // 2, dtype=np.uint8).tobytes())


def _tiny(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(good[:HEADER_BYTES - 1])


def _longer(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(good + b"appended by someone else")


def _random(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(np.random.default_rng(2).integers(0, 256, len(good), dtype=np.uint8).tobytes())


def _bit_flip(p: Path, good: bytes, other: bytes) -> None:
    data = bytearray(good)
    data[(HEADER_BYTES + len(data)) // 2] ^= 0x10  # mid-payload
    p.write_bytes(bytes(data))


def _other_key(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(other)  # another page's intact object: right size, checksum and format


def _other_version(p: Path, good: bytes, other: bytes) -> None:
    data = bytearray(good)
    struct.pack_into("<H", data, 4, 7)  # our magic, format version 7
    p.write_bytes(bytes(data))


def _zero_header(p: Path, good: bytes, other: bytes) -> None:
    p.write_bytes(bytes(HEADER_BYTES) + good[HEADER_BYTES:])


def _directory(p: Path, good: bytes, other: bytes) -> None:
    p.unlink()
    p.mkdir()


def _fifo(p: Path, good: bytes, other: bytes) -> None:
    p.unlink()
    os.mkfifo(p)


def _symlink(p: Path, good: bytes, other: bytes) -> None:
    p.unlink()
    target = p.with_name("elsewhere.bin")
    target.write_bytes(good)  # even a link to the very bytes is not followed
    p.symlink_to(target)


JUNK: dict[str, tuple[Callable[[Path, bytes, bytes], None], bool]] = {
    "empty": (_zero, True),
    "torn": (_torn, True),
    "shorter than a header": (_tiny, True),
    "short junk": (_short_junk, False),
    "longer": (_longer, False),
    "random": (_random, True),
    "bit flip": (_bit_flip, True),
    "another key's object": (_other_key, True),
    "zeroed header": (_zero_header, True),
    "another format version": (_other_version, False),
    "directory": (_directory, False),
    "fifo": (_fifo, False),
    "symlink": (_symlink, False),
}


# ------------------------------------------------- models that must not share pages


# Each variant's FULL object has the writer's size where the geometry allows it (the
# dangerous case: an object of the right size whose bytes mean something else).
WRITER = {"full": {"layers": 2, "bytes_per_token_per_layer": 8}}  # page 4: 64 B a page
VARIANTS: dict[str, dict[str, Any]] = {
    "page size": {"model__page_size": 8, "prefetch__threshold_tokens": 8,
                  "model__components": {"full": {"layers": 2, "bytes_per_token_per_layer": 4}}},
    "layers": {"model__components": {"full": {"layers": 1, "bytes_per_token_per_layer": 16}}},
    "head dims": {"model__components": {"full": {"layers": 2, "bytes_per_token_per_layer": 16}}},
    "tp size": {"model__tp_size": 2,
                "model__components": {"full": {"layers": 2, "bytes_per_token_per_layer": 4}}},
    "full+swa": {"swa_only": True},
    "a sidecar": {"sidecar": True},
    "kv dtype": {"model__kv_dtype": "float8_e4m3"},
    "model id": {"model__id": "demo-model-v2"},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_node_of_another_geometry_finds_none_of_the_writers_pages(
    variant: str, tmp_path: Path
) -> None:
    """One file store. The writer stored a prompt; a node whose model differs in one way
    derives other keys for every member of every page, finds nothing in L3 (no
    storage tokens, no prefetch) and stores its own objects beside the writer's."""
    prompt = seq(6, 50_000)
    with built_controllers(tmp_path, "geo") as make:
        writer = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
        Engine(writer, "w").request(prompt)
        assert writer.transfers.drain(10)
        other = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through",
                     **VARIANTS[variant])

        def keys(ctl: Any) -> set[str]:
            model = ctl.cfg.model
            blob = chain_hashes(model.chain_seed(""), prompt, model.page_size * 4)
            hashes = split_hashes(blob)
            return {k for kind in ctl._kinds for k in ctl.l3.keys("", hashes, model.family(kind))}

        assert not keys(writer) & keys(other), variant
        other.attach("probe", 0, other.cfg.model.tp_size)
        m = other.match("probe", MatchRequest("", prompt, lock=True, prefetch=True))
        assert (m.storage_tokens, m.prefetch_id) == (0, 0), variant
        assert other.l3.backend.stats().gets == 0
        other.release("probe", m.lock_id, None)
        if other.cfg.model.tp_size == 1:
            eng = Engine(other, "o")
            eng.request(prompt)
            assert other.transfers.drain(10)
            assert other.stats().counters["backups_l3"] == len(prompt) // 4 // other.cfg.model.page_size
            evict_all(other, Tier.DEVICE, Tier.HOST)
            again = other.match(eng.id, MatchRequest("", prompt, lock=True, prefetch=True))
            assert again.prefetch_id
            assert wait_prefetch(other, again.prefetch_id) is PrefetchState.DONE
            other.release(eng.id, again.lock_id, None)
            got = eng.request(prompt)  # its own pages, byte for byte
            assert got.device_tokens + got.host_tokens == len(prompt) // 4 and eng.checked
        assert writer.l3.backend.stats().corrupt == other.l3.backend.stats().corrupt == 0


@pytest.mark.timeout(60)
def test_namespaces_of_one_node_never_share_l3_pages(tmp_path: Path) -> None:
    """One node, one prompt in two namespaces: the second namespace's lookup finds nothing
    in L3 although every object of the first is there, and each reads back its own KV."""
    prompt = seq(6, 60_000)
    with built_controllers(tmp_path, "ns") as make:
        node = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
        a = Engine(node, "a", namespace="tenant-a")
        a.request(prompt)
        assert node.transfers.drain(10)
        evict_all(node, Tier.DEVICE, Tier.HOST)
        b = Engine(node, "b", namespace="tenant-b")
        m = node.match("b", MatchRequest("tenant-b", prompt, lock=True, prefetch=True))
        assert (m.storage_tokens, m.prefetch_id) == (0, 0)
        node.release("b", m.lock_id, None)
        assert b.request(prompt).device_tokens == 0
        assert node.transfers.drain(10)
        evict_all(node, Tier.DEVICE, Tier.HOST)
        for eng in (a, b):
            m = node.match(eng.id, MatchRequest(eng.ns, prompt, lock=True, prefetch=True))
            assert m.prefetch_id and wait_prefetch(node, m.prefetch_id) is PrefetchState.DONE
            node.release(eng.id, m.lock_id, None)
            got = eng.request(prompt)
            assert got.device_tokens + got.host_tokens == 24 and eng.checked >= 12
        assert node.l3.backend.stats().corrupt == 0


@pytest.mark.timeout(90)
def test_a_daemon_restarted_with_another_geometry_gets_no_hit_and_the_first_reads_its_own(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """One daemon writes a prompt to a file store and stops; restarted on the same store
    with a layout of equal object size (2 layers x 32 KiB instead of 4 x 16 KiB) it finds
    nothing and writes its own; restarted once more as the first, it prefetches and loads
    the first model's KV byte for byte and never the second's."""
    root = tmp_path / "l3"
    namespace = "restart"
    prompt = tokens(PAGES * PAGE, start=20_000)
    first_sets = _file_sets(root)
    second_sets = _file_sets(root, "model.components={full: {layers: 2, bytes_per_token_per_layer: 512}}")
    listen = f"unix://{tmp_path}/r.sock"

    d = make_daemon(*first_sets, listen=listen)
    with d.client(engine_id="first") as c:
        _write_prompt(c, Oracle(c.attach(), namespace, "first"), prompt, namespace)
        c.flush(timeout_s=10)
    assert d.stop() == 0
    files = {p for p in root.rglob("*.kv")}
    assert len(files) == PAGES

    d = make_daemon(*second_sets, listen=listen)
    with d.client(engine_id="second") as c:
        att = c.attach()
        assert att.info.members[0].layers == 2
        probe = c.match(prompt, namespace, prefetch=True)
        assert (probe.storage_tokens, probe.prefetch_id) == (0, 0)
        _write_prompt(c, Oracle(att, namespace, "second"), prompt, namespace)
        c.flush(timeout_s=10)
    assert d.stop() == 0
    assert len(set(root.rglob("*.kv")) - files) == PAGES  # its own objects, beside the first's

    d = make_daemon(*first_sets, listen=listen)
    with d.client(engine_id="first-again") as c:
        oracle = Oracle(c.attach(), namespace, "first")
        with c.matched(prompt, namespace, prefetch=True) as m:
            assert m.storage_tokens == PAGES * PAGE and m.prefetch_id
            assert _wait_prefetch(c, m.prefetch_id) is PrefetchState.DONE
        with c.matched(prompt, namespace) as hit:
            last = list(c.load(hit.lock_id))[-1]
            assert last.device_tokens == PAGES * PAGE and last.device_pages is not None
            oracle.verify(prompt, last.device_pages, PAGES)
        assert oracle.pages_checked == PAGES * 4 and oracle.wrong_bytes == 0


# ------------------------------------------------------------- junk in a file store


@pytest.fixture(scope="module")
def junk_scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A writer daemon stored one prompt per kind of junk (6 pages each) in a file store;
    then page BAD of each prompt was replaced by that junk. A reader daemon on the same
    store has its own prompt in L1, locked, and reads each junk prompt (prefetch + load)."""
    tmp = tmp_path_factory.mktemp("junk")
    root = tmp / "l3"
    port = free_port()
    writer = Daemon(tmp, *_file_sets(root), listen=f"unix://{tmp}/w.sock")
    reader = Daemon(tmp, *_file_sets(root, f"metrics.port={port}"), listen=f"unix://{tmp}/r.sock")
    namespace = "junk"
    prompts = {name: tokens(PAGES * PAGE, start=100_000 + 1_000 * i) for i, name in enumerate(JUNK)}
    try:
        writer.start(wait=False)
        reader.start(wait=False)
        writer.wait_ready()
        reader.wait_ready()
        with writer.client(engine_id="w") as w:
            oracle = Oracle(w.attach(), namespace, "demo")
            for prompt in prompts.values():
                _write_prompt(w, oracle, prompt, namespace)
                w.flush(timeout_s=10)
            assert w.stats().counters["backups_storage"] == PAGES * len(JUNK)
        planted: dict[str, Path] = {}
        for name, prompt in prompts.items():
            keys = _page_keys(writer, prompt, namespace)
            path = _object_path(root, keys[BAD])
            good = path.read_bytes()
            other = _object_path(root, keys[BAD + 1]).read_bytes()
            JUNK[name][0](path, good, other)
            planted[name] = path
        yield {"reader": reader, "port": port, "root": root, "ns": namespace,
               "prompts": prompts, "planted": planted}
    finally:
        writer.close()
        reader.close()


@pytest.mark.timeout(120)
def test_junk_at_one_page_of_a_file_store_is_a_counted_miss_never_wrong_kv(
    junk_scene: dict[str, Any],
) -> None:
    """For every kind of junk: the reader's prefetch ends FAILED with the pages before the
    junk ready, the locked match and its Load bring exactly those pages into L1, byte for
    byte, each junk object is counted found once (and removed only when it is an object
    of ours, broken), and the reader's own locked L1 pages keep their bytes throughout."""
    reader: Daemon = junk_scene["reader"]
    ns, port = junk_scene["ns"], junk_scene["port"]
    mine = tokens(4 * PAGE, start=900_000)
    with reader.client(engine_id="r") as c:
        att = c.attach()
        oracle = Oracle(att, ns, "demo")
        _write_prompt(c, oracle, mine, ns)
        held = c.match(mine, ns, lock=True)  # pinned in L1 while the junk is read
        assert held.device_tokens == 4 * PAGE
        before = _corrupt_found(port)
        for name, prompt in junk_scene["prompts"].items():
            with c.matched(prompt, ns, prefetch=True) as m:
                assert m.device_tokens == m.host_tokens == 0, name
                assert m.prefetch_id, name
                assert _wait_prefetch(c, m.prefetch_id) is PrefetchState.FAILED, name
                info = c.prefetch_status(m.prefetch_id)
                assert (info.tokens_ready, info.tokens_total) == (BAD * PAGE, PAGES * PAGE), name
            with c.matched(prompt, ns) as hit:
                assert hit.device_tokens + hit.host_tokens == BAD * PAGE, name
                last = list(c.load(hit.lock_id))[-1]
                assert last.device_tokens == BAD * PAGE and last.device_pages is not None, name
                oracle.verify(prompt, last.device_pages, BAD)
            assert oracle.wrong_bytes == 0, name
            found = _corrupt_found(port)
            assert found == before + 1, name
            before = found
            path: Path = junk_scene["planted"][name]
            assert os.path.lexists(path) is not JUNK[name][1], name
        oracle.verify(mine, held.device_pages, 4)  # untouched by every zeroed junk read
        c.release(lock_id=held.lock_id)
        assert oracle.wrong_bytes == 0 and oracle.pages_checked == (4 + BAD * len(JUNK)) * 4
        removed = _metric(scrape(port), "hicache_l3_corrupt_objects_total",
                          'action="removed",backend="file"')
        assert removed == sum(1 for _, ours in JUNK.values() if ours)
        assert c.serving() and c.health(deep=True)[0].healthy


@pytest.mark.timeout(60)
def test_health_deep_of_a_file_store_full_of_junk_is_healthy(junk_scene: dict[str, Any]) -> None:
    """`hicache health --deep` with junk all over the store (the planted objects: empty,
    torn, random, a directory, a FIFO, a link...; stray names at its root): exit 0, the
    backend healthy, its canary round trip done."""
    root: Path = junk_scene["root"]
    (root / "stray.kv").write_bytes(b"x")
    (root / "zz-not-ours").mkdir(exist_ok=True)
    out = run_cli("health", "--deep", "--json", "--target", junk_scene["reader"].target)
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    (backend,) = report["backends"]
    assert backend["healthy"] and "canary" in backend["detail"], backend


# --------------------------------------------------------- junk in a Redis store


def _redis_junk(r: redis.Redis, key: str, good: bytes, other: bytes, kind: str) -> None:
    r.delete(key)
    if kind == "a list":
        r.rpush(key, good)
    elif kind == "a hash":
        r.hset(key, "v", good)
    elif kind == "empty":
        r.set(key, b"")
    elif kind == "torn":
        r.set(key, good[: len(good) // 2])
    elif kind == "longer":
        r.set(key, good + b"tail")
    elif kind == "random":
        r.set(key, np.random.default_rng(3).integers(0, 256, len(good), dtype=np.uint8).tobytes())
    elif kind == "another key's object":
        r.set(key, other)
    else:
        raise AssertionError(kind)


REDIS_JUNK = ("a list", "a hash", "empty", "torn", "longer", "random", "another key's object")


@pytest.mark.timeout(60)
def test_junk_values_in_redis_are_counted_misses_and_the_intact_prefix_is_exact(
    tmp_path: Path, redis_server: Any
) -> None:
    """A Redis store (with a TTL, so reads renew it) holding junk at one page of each
    prompt: another type, empty, torn, longer, random, another key's value. A second node
    prefetches what is intact before it, byte for byte; every junk value is one corrupt
    key, and the node's own L1 content stays exact."""
    ns = f"rj-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_server.url)
    kw = {"backend": "redis", "storage__redis": {"url": redis_server.url, "ttl_s": 600},
          "write__l1_to_l2": "write_through", "write__l2_to_l3": "write_through"}
    prompts = {kind: seq(6, 70_000 + 100 * i) for i, kind in enumerate(REDIS_JUNK)}
    try:
        with built_controllers(tmp_path, "rj") as make:
            writer = make(**kw)
            w = Engine(writer, "w", namespace=ns)
            for prompt in prompts.values():
                w.request(prompt)
            assert writer.transfers.drain(10)
            for kind, prompt in prompts.items():
                keys = writer.l3.keys(ns, w.hashes(prompt), writer.cfg.model.family(FULL))
                _redis_junk(r, keys[BAD], r.get(keys[BAD]) or b"", r.get(keys[BAD + 1]) or b"", kind)
            reader = make(**kw)
            e = Engine(reader, "e", namespace=ns)
            mine = seq(3, 80_000)
            e.request(mine)
            held = reader.match("e", MatchRequest(ns, mine, lock=True))
            for kind, prompt in prompts.items():
                m = reader.match("e", MatchRequest(ns, prompt, lock=True, prefetch=True))
                assert m.storage_tokens == 24 and m.prefetch_id, kind
                assert wait_prefetch(reader, m.prefetch_id) is PrefetchState.FAILED, kind
                assert reader.prefetch_status(m.prefetch_id).tokens_ready == BAD * 4, kind
                reader.release("e", m.lock_id, None)
                got = e.request(prompt)  # loads the intact pages (verified), computes the rest
                assert got.device_tokens + got.host_tokens == BAD * 4, kind
            e.verify(held.device_pages, mine, 3)
            reader.release("e", held.lock_id, None)
            stats = reader.l3.backend.stats()
            assert stats.corrupt == len(REDIS_JUNK)
            assert stats.corrupt_removed == 4  # empty, torn, random, another key's: ours, broken
            assert reader.health(deep=True)[0].healthy
    finally:
        for key in r.scan_iter(match="hc2/*", count=1000):
            r.delete(key)
        r.close()


# ------------------------------------------------- junk in a hybrid model's objects


@pytest.mark.timeout(60)
@pytest.mark.parametrize("member,page,how", [
    ("swa", 5, "random"), ("swa", 4, "torn"), ("mamba", 5, "random"), ("conv", 5, "longer"),
    ("indexer", 1, "bit flip"), ("full", 2, "empty"),
])
def test_junk_in_a_hybrid_models_window_checkpoint_or_sidecar_is_never_reused(
    tmp_path: Path, member: str, page: int, how: str
) -> None:
    """FULL+SWA+MAMBA with sidecars, 6 pages in L3 alone; one object of one member is
    junk. The prefetch fails with nothing reusable (the only checkpoint is at the end),
    the next request reuses nothing it would have to trust, and once it recomputed the
    prompt a prefetch brings it all back exactly (unless the junk is not ours to remove)."""
    make_junk = {"random": _random, "torn": _torn, "longer": _longer, "bit flip": _bit_flip,
                 "empty": _zero}[how]
    prompt = seq(6, 30_000)
    with built_controllers(tmp_path, "hy") as make:
        node = make(hybrid=True, write__l1_to_l2="write_through", write__l2_to_l3="write_through")
        Engine(node, "w").request_then_only_in_l3(prompt)
        hashes = Engine(node, "k").hashes(prompt)
        spec = [m for m in node.cfg.model.members if m.name == member]
        path = Path(node.l3.backend.path_of(node.l3.keys("", hashes[page : page + 1], spec)[0]))
        make_junk(path, path.read_bytes(), b"")
        eng = Engine(node, "e")
        m = node.match("e", MatchRequest("", prompt, lock=True, prefetch=True))
        assert m.prefetch_id
        assert wait_prefetch(node, m.prefetch_id) is PrefetchState.FAILED
        assert node.prefetch_status(m.prefetch_id).tokens_ready == 0
        node.release("e", m.lock_id, None)
        node.check_integrity()
        got = eng.request(prompt)
        assert got.device_tokens + got.host_tokens == 0
        assert node.l3.backend.stats().corrupt == 1
        assert node.transfers.drain(10)
        evict_all(node, Tier.DEVICE, Tier.HOST)
        again = Engine(node, "again")
        m = node.match("again", MatchRequest("", prompt, lock=True, prefetch=True))
        ours = how != "longer"
        if ours:  # removed at the read, written again by the recompute
            assert m.prefetch_id and wait_prefetch(node, m.prefetch_id) is PrefetchState.DONE
        node.release("again", m.lock_id, None)
        got = again.request(prompt)  # whatever it reuses, verified byte for byte
        if ours:
            assert got.device_tokens + got.host_tokens == 24 and again.checked >= 31


# ------------------------------------------------------------------ bugs found


@pytest.mark.timeout(60)
def test_a_junk_file_at_a_fanout_folder_does_not_fail_the_deep_health_canary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canary's random key pinned (a fixed uuid4, for each check's first key) to one
    whose top fan-out folder is a junk file: the store serves reads and takes every other key's writes, so the deep
    check must find it healthy and the breaker must stay closed."""
    fixed = uuid.UUID(int=0x5EED)
    first = [fixed] * 3  # each deep check's first key (the next are random, as in service)
    monkeypatch.setattr(storage_base, "uuid", types.SimpleNamespace(
        uuid4=lambda: first.pop() if first else uuid.uuid4()))
    key = f"{CANARY_PREFIX}{socket.gethostname()}/{os.getpid()}/{fixed.hex}"
    folder = key_digest(key).hex()[:2]
    prompt = seq(6, 40_000)
    with built_controllers(tmp_path, "cn") as make:
        node = make(storage__required=True, write__l1_to_l2="write_through",
                    write__l2_to_l3="write_through")
        root = Path(node.cfg.storage.file.path)
        assert node.l3.probe(deep=True).healthy
        shutil.rmtree(root / folder, ignore_errors=True)
        (root / folder).write_bytes(b"left here by someone else")
        eng = Engine(node, "e")
        eng.request(prompt)
        assert node.transfers.drain(10)
        results = [node.l3.probe(deep=True) for _ in range(3)]
        assert all(h.healthy for h in results), results[0].detail
        assert node.serving() and not node.l3.breaker.is_open


@pytest.mark.timeout(60)
def test_every_l3_call_after_a_corrupt_read_is_timed(tmp_path: Path) -> None:
    """A corrupt object read by a prefetch: each existence call the controller then makes
    on the backend shows in the `exists` latency series."""
    prompt = seq(6, 45_000)
    with built_controllers(tmp_path, "tm") as make:
        node = make(write__l1_to_l2="write_through", write__l2_to_l3="write_through")
        eng = Engine(node, "e")
        eng.request_then_only_in_l3(prompt)
        key = node.l3.keys("", eng.hashes(prompt)[2:3], node.cfg.model.family(FULL))[0]
        path = Path(node.l3.backend.path_of(key))
        _longer(path, path.read_bytes(), b"")
        calls = [0]
        real = node.l3.backend.exists_prefix

        def counted(keys: Any) -> int:
            calls[0] += 1
            return real(keys)

        node.l3.backend.exists_prefix = counted  # type: ignore[method-assign]

        def timed() -> int:
            return sum(s.count for s in node.l3.stats().ops if s.op is L3Op.EXISTS)

        before = timed()
        m = node.match("e", MatchRequest("", prompt, lock=True, prefetch=True))
        assert wait_prefetch(node, m.prefetch_id) is PrefetchState.FAILED
        node.release("e", m.lock_id, None)
        assert node.l3.backend.stats().corrupt == 1
        assert calls[0] >= 1
        assert timed() - before == calls[0]
