"""Mutation review, session 31 (controller): two mutants that lived through the controller
and the daemon tests alike. `L3Store.write` (controller/storage_io.py) where one object of
a page's family fails to store and its others do (a real failure: a file where the
object's folder belongs); `Loads.give_back` (controller/loads.py) after the allocation
moved on while its lent pages were copying. Real controllers (`make`) over the real file
backend; the load's failure an injected copy error."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_sim import CopyGate, Engine, Loader, l1_full, l2_prefix_request, seq

from hicache.controller.base import AllocateRequest, InsertRequest
from hicache.types import ComponentKind

FULL = ComponentKind.FULL


def test_a_page_whose_sidecar_object_failed_to_store_is_not_landed_nor_known_present(make) -> None:
    """A FULL family with an indexer sidecar: a page is two objects (full, indexer). A
    file sits where page 1's indexer object's folder belongs, so that object's put fails
    while the page's full object and page 0's two objects are stored. The write lands
    page 0 only (page 1 would read back without its sidecar), and the store does not
    remember page 1's objects as present: with that file gone, a lookup finds one
    page, not two.
    Mutant killed: a page counted landed when ANY of its objects was stored or present
    (`any(...)` for `all(...)` in `L3Store.write`): page 1 landed, its keys cached present,
    and the lookup promises a page whose sidecar L3 does not hold."""
    ctl = make(sidecar=True)
    store = ctl.l3
    family = ctl.cfg.model.family(FULL)
    assert [m.name for m in family] == ["full", "indexer"]
    hashes = [bytes([5]) * 32, bytes([6]) * 32]
    keys = store.keys("", hashes, family)
    blocker = os.path.dirname(store.backend.path_of(keys[3]))  # page 1's indexer's folder
    assert all(os.path.dirname(store.backend.path_of(k)) != blocker for k in keys[:3])
    os.makedirs(os.path.dirname(blocker), exist_ok=True)
    with open(blocker, "w") as f:
        f.write("in the way")
    written = store.write("", hashes, family, np.array([0, 1], np.int64))
    assert (written.landed, written.found) == ((0,), ())
    assert store.backend.exists_prefix(keys[:3]) == 3  # (the others were stored)
    os.unlink(blocker)
    assert store.present_run("", hashes, family) == 1
    assert store.read("", hashes, family, np.array([2, 3], np.int64)) == 1


def test_a_load_failing_after_a_keep_lock_insert_moved_the_allocation_on_frees_what_it_lent(
    make,
) -> None:
    """Two Load streams of one lock (e.g. two ranks): the first lends the allocation's
    first 8 pages and its copy is held; the second (after LOAD_WAIT_S) copies into pages
    of its own and lands. The engine then writes its 4 new pages and inserts them with
    keep_lock, which moves the allocation on past them; then the first copy fails. Its
    lent pages cannot go back in front of the allocation (which stands for the token
    pages after the insert now): they are freed, and the request's decode growth and
    final Insert land byte-exact.
    Mutant killed: `give_back` returning the pages to an allocation that moved on (its
    `start_page` check dropped): the allocation then claims token pages 0-7 again, and
    the final Insert is refused (it finds no pages for token pages 12-13)."""
    ctl = make(l1_tokens=128, write__l1_to_l2="write_through", storage__backend="none")
    eng = Engine(ctl)
    prefix, prompt, m = l2_prefix_request(ctl, eng, base=1700, tail_base=9700)
    gate = CopyGate(ctl, first_only=True)
    gate.fail = True
    try:
        first = gate.held_load("e1", m.lock_id)
        second = Loader(ctl, "e1", m.lock_id)
        second.start()
        got = second.result()[-1]
        eng.verify(got.device_pages, prefix, 8)
        eng.write({"full": m.pages["full"][8:]}, prompt, 8)
        out = ctl.insert("e1", InsertRequest("", prompt, lock_id=m.lock_id,
                                             allocation_id=m.allocation_id, keep_lock=True))
        assert (out.inserted_tokens, out.reused_tokens) == (16, 32)
        gate.open()
        with pytest.raises(OSError, match="injected copy failure"):
            first.result()
    finally:
        gate.restore()
    rec = ctl._engines.allocation("e1", m.allocation_id)
    assert rec.start_page == 12 and len(rec.pages[FULL]) == 0
    with ctl._mu:
        assert ctl.loads.lent_from(rec) == 0
    ctl.check_integrity()
    grown = ctl.allocate("e1", AllocateRequest("", 8, allocation_id=m.allocation_id))
    decoded = prompt + seq(2, base=9800)
    eng.write({"full": grown.pages["full"]}, decoded, 12)
    out = ctl.insert("e1", InsertRequest("", decoded, lock_id=m.lock_id, allocation_id=m.allocation_id))
    assert (out.inserted_tokens, out.reused_tokens) == (8, 48)
    eng.assert_cached(decoded)
    assert l1_full(ctl)[0] == 14  # (the loaded 8, the inserted 4, the decoded 2: the lent 8 freed)
