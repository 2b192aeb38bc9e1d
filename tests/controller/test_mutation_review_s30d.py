"""Mutation review, fourth round (controller): what `L3Store` (controller/storage_io.py)
does around its backend that no other test pinned; each test names the mutant it kills
and passes on the product as it is. Real controllers (`make`) over the real file backend;
a test that counts backend calls wraps the backend's own method and calls through."""

from __future__ import annotations

import numpy as np

from hicache.types import ComponentKind

FULL = ComponentKind.FULL


def _count_exists(store) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the store's `exists_prefix` calls to its backend (each still goes through)."""
    calls = [0]
    real = store.backend.exists_prefix

    def counted(keys):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(keys)

    store.backend.exists_prefix = counted
    return calls


def test_a_page_whose_sidecar_object_is_gone_is_absent_and_remembered_as_absent(make) -> None:
    """A FULL family with an indexer sidecar: a page is two objects (full, indexer). Two
    pages are written to L3, then page 1's indexer object is deleted from the store and
    the existence cache is cleared. A lookup of both pages asks the store once and finds
    one page (keys: page 0 both, page 1 full only: a run of 3 keys is 1 page). A second
    lookup answers 1 page from the cache alone: page 1's full key is known present, its
    indexer key known absent (no second backend call).
    Mutants killed: `_stored_run` rounding a cache-stopped run of keys up to pages
    (`-(-known // len(members))`: 3 keys -> 2 pages, promising a page L3 cannot serve),
    and `_stored_run` not marking the first missing key absent (`add_absent(keys[run])`
    dropped: the second lookup asks the store again)."""
    ctl = make(sidecar=True)
    store = ctl.l3
    family = ctl.cfg.model.family(FULL)
    assert [m.name for m in family] == ["full", "indexer"]
    hashes = [bytes([1]) * 32, bytes([2]) * 32]
    written = store.write("", hashes, family, np.array([0, 1], np.int64))
    assert (written.landed, written.found) == ((0, 1), ())
    keys = store.keys("", hashes, family)
    assert store.backend.delete([keys[3]]) == 1
    store.cache.clear()
    calls = _count_exists(store)
    assert store.present_run("", hashes, family) == 1
    assert calls[0] == 1
    assert store.present_run("", hashes, family) == 1
    assert calls[0] == 1


def test_a_rewrite_that_stores_a_missing_sidecar_object_counts_the_page_as_stored(make) -> None:
    """A FULL family with an indexer sidecar. Page A is written to L3, then its indexer
    object is deleted from the store. Writing A again answers PRESENT for its full object
    and STORED for its indexer: the page lands (`landed` (0,)) and counts as stored by
    this write (`found` (), `stored` 1), not as "there already". A third write finds both
    objects: `found` (0,), `stored` 0.
    Mutant killed: `L3Store.write` calling a page found when ANY of its objects answered
    PRESENT (`if was_there:` for `len(was_there) == per`): the second write then reports
    `found` (0,) and `stored` 0, though it stored the page's sidecar."""
    ctl = make(sidecar=True)
    store = ctl.l3
    family = ctl.cfg.model.family(FULL)
    hashes = [bytes([7]) * 32]
    slots = np.array([2], np.int64)
    first = store.write("", hashes, family, slots)
    assert (first.landed, first.found, first.stored) == ((0,), (), 1)
    keys = store.keys("", hashes, family)
    assert store.backend.delete([keys[1]]) == 1
    again = store.write("", hashes, family, slots)
    assert (again.landed, again.found, again.stored, again.in_l3) == ((0,), (), 1, 1)
    third = store.write("", hashes, family, slots)
    assert (third.landed, third.found, third.stored) == ((0,), (0,), 0)


def test_l3_stats_report_the_bytes_read_and_the_bytes_written_each_in_its_own_field(make) -> None:
    """Two one-object pages (FULL, no sidecar) are written to a fresh L3, then one of them
    is read back into another L2 slot: `stats()` says bytes_written = 2 objects and
    bytes_read = 1 object (each object its full size, header included), and the read
    page's bytes equal the written one's.
    Mutant killed: `L3Store.stats` passing the backend's bytes_written as bytes_read and
    bytes_read as bytes_written (`snapshot(counted.bytes_written, counted.bytes_read, ...)`)."""
    ctl = make()
    store = ctl.l3
    family = ctl.cfg.model.family(FULL)
    assert [m.name for m in family] == ["full"]
    size = store.host.object_views("full", np.array([0], np.int64))[0].nbytes
    hashes = [bytes([3]) * 32, bytes([4]) * 32]
    assert store.write("", hashes, family, np.array([4, 5], np.int64)).stored == 2
    assert store.read("", hashes[1:], family, np.array([6], np.int64)) == 1
    views = store.host.object_views("full", np.array([5, 6], np.int64))
    assert bytes(views[0]) == bytes(views[1])
    stats = store.stats()
    assert (stats.bytes_written, stats.bytes_read) == (2 * size, size)
