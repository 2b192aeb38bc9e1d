"""Mutation review (session 31) of the controller's workers and L3 existence cache."""

from __future__ import annotations

import threading

from hicache.controller.workers import ExistenceCache, Job, Worker


def test_drain_reports_a_timeout_while_a_job_is_still_running() -> None:
    """`drain` answers False when its time is up with a job unfinished (a flush or a
    shutdown must not report L3 written while a backup is still on its way), then True
    once the job finished."""
    # Mutant: Worker.drain returning True on timeout.
    release = threading.Event()
    started = threading.Event()
    worker = Worker("s31", capacity=4, retries=0, backoff_s=0.0)
    worker.start()
    try:
        def blocked() -> None:
            started.set()
            release.wait()

        assert worker.submit(Job("blocked", blocked, lambda e: None))
        assert started.wait(10)
        assert worker.drain(0.0) is False
        release.set()
        assert worker.drain(10.0) is True
    finally:
        release.set()
        worker.close()


def test_forgotten_keys_are_no_longer_known_present() -> None:
    """A key the controller forgets (its object found missing or unreadable) is asked of
    the store again: a match must not promise an L3 page on the cache's word alone."""
    # Mutant: ExistenceCache.forget not removing the key.
    cache = ExistenceCache()
    ks = ["k0", "k1", "k2"]
    cache.add_present(ks)
    assert cache.known_run(ks) == (3, False)
    cache.forget(["k1"])
    assert cache.known_run(ks) == (1, False)
    cache.add_present(["k1"])
    assert cache.known_run(ks) == (3, False)


def test_a_key_found_present_drops_its_absent_mark() -> None:
    """Once a key is known present (a put or a lookup found it), an older "absent" mark
    on it is gone: forgetting it later means "ask the store", not "known absent" (which
    would turn a page stored meanwhile into a miss until the mark's TTL ran out)."""
    # Mutant: ExistenceCache.add_present keeping the absent marks of the keys it adds.
    cache = ExistenceCache(negative_ttl_s=3600.0)
    cache.add_absent("k0")
    assert cache.known_run(["k0"]) == (0, True)
    cache.add_present(["k0"])
    assert cache.known_run(["k0"]) == (1, False)
    cache.forget(["k0"])
    assert cache.known_run(["k0"]) == (0, False)
