"""Two daemons sharing one L3 store: the second hits, prefetches and loads what the first
stored, and the bytes its engine reads are the ones the first engine wrote.

Each daemon is a real `hicache serve` process with its own socket and shared memory. With
Mooncake each daemon is its own store client lending its own segment, and an object lives
in the segment of the client that stored it: the first daemon stays up while the second
reads.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.bench.oracle import KvOracle
from hicache.client import Client
from hicache.controller.base import PrefetchState

from .daemonkit import PAGE, Daemon, tokens

MakeDaemon = Callable[..., Daemon]
PAGES = 6  # 384 tokens: above the prefetch threshold (256), within L1 (16 pages)
WRITE_THROUGH = ("write.l1_to_l2=write_through", "write.l2_to_l3=write_through",
                 "prefetch.policy=wait_complete")


def _redis_sets(request: pytest.FixtureRequest) -> tuple[str, ...]:
    server = request.getfixturevalue("redis_server")
    return ("storage.backend=redis", f"storage.redis.url={server.url}")


def _mooncake_sets(request: pytest.FixtureRequest) -> tuple[str, ...]:
    master = request.getfixturevalue("mooncake_master")
    return (
        "storage.backend=mooncake",
        f"storage.mooncake.master={master.master}",
        f"storage.mooncake.metadata_server={master.metadata_server}",
        f"storage.mooncake.global_segment_size={64 << 20}",
        f"storage.mooncake.local_buffer_size={16 << 20}",
    )


BACKENDS = {"redis": _redis_sets, "mooncake": _mooncake_sets}


def _wait_prefetch(c: Client, prefetch_id: int, timeout_s: float = 15.0) -> PrefetchState:
    deadline = time.monotonic() + timeout_s
    while True:
        info = c.prefetch_status(prefetch_id)
        if info.state is not PrefetchState.RUNNING or time.monotonic() > deadline:
            return info.state
        time.sleep(0.02)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_second_daemon_loads_what_the_first_stored(
    backend: str, request: pytest.FixtureRequest, make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    sets = (*WRITE_THROUGH, "storage.required=true", *BACKENDS[backend](request))
    namespace = f"shared-{uuid.uuid4().hex[:8]}"  # the store outlives this test
    prompt = tokens(PAGES * PAGE, start=70_000)
    first = make_daemon(*sets, listen=f"unix://{tmp_path}/first.sock")
    second = make_daemon(*sets, listen=f"unix://{tmp_path}/second.sock")

    with first.client(engine_id="writer") as w:
        att = w.attach()
        writer = KvOracle(att.info, att.pools, namespace)
        m = w.match(prompt, namespace, lock=True, allocate_tokens=PAGES * PAGE)
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 0)
        writer.write(prompt, m.pages, start_page=0)
        w.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)
        w.flush(timeout_s=10)  # waits for the queued write-through jobs
        assert w.stats().counters["backups_storage"] == PAGES

    # The first daemon stays up: with Mooncake its segment holds the objects.
    with second.client(engine_id="reader") as r:
        att = r.attach()
        reader = KvOracle(att.info, att.pools, namespace)
        probe = r.match(prompt, namespace)
        assert (probe.device_tokens, probe.host_tokens, probe.storage_tokens) == (0, 0, PAGES * PAGE)

        with r.matched(prompt, namespace, prefetch=True) as m:
            assert m.storage_tokens == PAGES * PAGE and m.prefetch_id
            assert _wait_prefetch(r, m.prefetch_id) is PrefetchState.DONE
            assert r.prefetch_status(m.prefetch_id).tokens_ready == PAGES * PAGE

        with r.matched(prompt, namespace) as hit:
            # Prefetched pages follow into free L1 pages; what did not stays in L2.
            assert hit.device_tokens + hit.host_tokens == PAGES * PAGE
            steps = list(r.load(hit.lock_id))
            last = steps[-1]
            assert last.layers_ready == last.layers_total == att.info.members[0].layers
            assert last.device_tokens == PAGES * PAGE and last.device_pages is not None
            reader.verify(prompt, last.device_pages, PAGES)
        assert reader.pages_checked == PAGES * att.info.members[0].layers
        assert reader.wrong_bytes == 0

        again = r.match(prompt, namespace)
        assert again.device_tokens == PAGES * PAGE  # now in the second daemon's own L1
        counters = r.stats().counters
        assert counters["prefetches_done"] == 1
    assert first.proc is not None and first.proc.poll() is None

