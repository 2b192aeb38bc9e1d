"""SIGTERM with write-back data: the daemon writes it down to L3 before it exits, and a
new daemon on the same file directory serves it (bytes checked by the content oracle)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from hicache.bench.oracle import KvOracle
from hicache.controller.base import PrefetchState

from .daemonkit import PAGE, Daemon, tokens

MakeDaemon = Callable[..., Daemon]


def test_sigterm_writes_write_back_data_down_to_l3(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    store = tmp_path / "l3"
    sets = ("write.l1_to_l2=write_back", "write.l2_to_l3=write_back", "storage.backend=file",
            f"storage.file.path={store}", "prefetch.policy=wait_complete")
    prompt = tokens(5 * PAGE, start=80_000)
    d = make_daemon(*sets)
    with d.client() as c:
        att = c.attach()
        segments = [Path("/dev/shm") / p.handle.decode() for p in att.info.pools]
        oracle = KvOracle(att.info, att.pools)
        m = c.match(prompt, lock=True, allocate_tokens=5 * PAGE)
        oracle.write(prompt, m.pages, start_page=0)
        c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
        assert c.match(prompt).device_tokens == 5 * PAGE
        assert c.stats().counters["backups_storage"] == 0  # write-back: nothing went down yet
    objects_before = [p for p in store.rglob("*") if p.is_file()]
    assert d.stop(signal.SIGTERM) == 0
    assert not any(s.exists() for s in segments)
    assert not d.socket.exists()
    assert "flushed 5 pages" in d.log(), d.log()
    objects = [p for p in store.rglob("*") if p.is_file()]
    assert len(objects) - len(objects_before) >= 5

    after = make_daemon(*sets, listen=f"unix://{tmp_path}/after.sock")
    with after.client() as c:
        att = c.attach()
        oracle = KvOracle(att.info, att.pools)
        with c.matched(prompt, prefetch=True) as m:
            assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 5 * PAGE)
            deadline = time.monotonic() + 15
            while (c.prefetch_status(m.prefetch_id).state is PrefetchState.RUNNING
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            assert c.prefetch_status(m.prefetch_id).state is PrefetchState.DONE
        with c.matched(prompt) as hit:
            last = list(c.load(hit.lock_id))[-1]
            assert last.device_pages is not None and last.device_tokens == 5 * PAGE
            oracle.verify(prompt, last.device_pages, 5)
        assert oracle.pages_checked == 5 * att.info.members[0].layers and oracle.wrong_bytes == 0
