"""Mutation review, second round (L3 storage): the object header's verdicts, the bounded
caller's zero budget and the Mooncake client's registered-region check, which no other
test pinned; each test names the mutant it kills."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from storage_pages import Pool, keys, mooncake_config

from hicache.bench.services import MooncakeMaster
from hicache.errors import BackendTimedOut, InvalidArgument
from hicache.tiers.storage import GetStatus, PutStatus, StorageBackend, build_backend
from hicache.tiers.storage.bounded import BoundedCaller
from hicache.tiers.storage.integrity import (
    FORMAT_VERSION,
    HEADER_BYTES,
    other_format,
    truncated_of_ours,
    write_header,
)


def _object(key: str, payload: int = 256) -> np.ndarray:
    obj = np.zeros(HEADER_BYTES + payload, dtype=np.uint8)
    obj[HEADER_BYTES:] = np.arange(payload) % 251
    write_header(obj, key)
    return obj


def test_a_whole_object_of_ours_is_not_taken_for_a_torn_one() -> None:
    """A valid 320-byte object read whole (`stored_bytes` == its size) is no torn write:
    `truncated_of_ours` says False; one byte short, with our header, it says True; one
    byte short under another key, False.
    Mutant killed: `truncated_of_ours` with `stored_bytes <= len(view)` (a whole object
    reported torn: the reader would drop a good page)."""
    obj = _object("ns/page-1")
    assert not truncated_of_ours(obj, "ns/page-1", obj.nbytes)
    assert truncated_of_ours(obj, "ns/page-1", obj.nbytes - 1)
    assert not truncated_of_ours(obj, "ns/page-2", obj.nbytes - 1)


def test_our_own_format_version_is_not_another_format() -> None:
    """`other_format` tells objects written by another daemon version (ours, in another
    format version: not this daemon's to judge) from our own: an object in
    FORMAT_VERSION is not "other"; the same header with the version bumped is.
    Mutant killed: `other_format` true for any object with our magic (every corrupt
    object of ours would be left alone as another version's)."""
    obj = _object("ns/page-1")
    assert not other_format(obj)
    obj[4:6] = np.frombuffer(np.uint16(FORMAT_VERSION + 1).tobytes(), dtype=np.uint8)
    assert other_format(obj)


def test_a_map_with_no_time_left_runs_nothing() -> None:
    """`BoundedCaller.map` with `timeout_s=0` (the caller's budget spent) raises
    BackendTimedOut at once with no pending call: none of its parts is submitted, so
    none runs and none is counted stuck.
    Mutant killed: `map` checking `timeout < 0` (both parts run, and count as stuck)."""
    caller = BoundedCaller("test", timeout_s=5.0, workers=2)
    ran: list[int] = []
    try:
        with pytest.raises(BackendTimedOut) as err:
            caller.map(ran.append, [(1,), (2,)], timeout_s=0)
        assert err.value.pending == []
        assert caller.wait_idle(5.0)
        assert ran == []
        assert caller.stuck == 0
    finally:
        caller.close(5.0)


@pytest.fixture
def mooncake(mooncake_master: MooncakeMaster) -> Iterator[StorageBackend]:
    backend = build_backend(mooncake_config(mooncake_master))
    yield backend
    backend.close()


def test_a_mooncake_buffer_running_past_its_registered_region_is_refused(
    mooncake: StorageBackend,
) -> None:
    """Mooncake moves bytes by address: a buffer must lie inside memory registered with
    `register_host_buffer`. Only the first 3 of a 4-slot pool are registered; a put or a
    get with the pool's 3rd slot works, and one whose buffer starts in the registered
    part and runs one byte past its end is InvalidArgument naming the cause, before any
    byte moves (the store then holds nothing under that key).
    Mutant killed: `MooncakeBackend._addresses` checking only where a buffer starts
    (`end <= hi` dropped): the transfer engine would read or write past the region."""
    pool = Pool(4, seed=5)
    registered = 3 * pool.slot
    mooncake.register_host_buffer(pool.memory.ctypes.data, registered)
    try:
        inside, past = keys(2, "mr30b-region")
        assert mooncake.put_from([inside], [pool.pages[2]]) == [PutStatus.STORED]
        straddling = pool.memory[registered - pool.slot + 1 : registered + 1]
        assert straddling.nbytes == pool.slot
        with pytest.raises(InvalidArgument, match="outside every registered region"):
            mooncake.put_from([past], [straddling])
        with pytest.raises(InvalidArgument, match="outside every registered region"):
            mooncake.get_into([inside], [straddling])
        assert mooncake.exists_prefix([inside, past]) == 1  # (the refused put stored nothing)
        dst = pool.pages[1]
        assert mooncake.get_into([inside], [dst]) == [GetStatus.HIT]
        assert np.array_equal(dst, pool.pages[2])
    finally:
        mooncake.unregister_host_buffer(pool.memory.ctypes.data)
