"""`mooncake` backend: a `MooncakeDistributedStore` client, zero-copy from/to L2 pages.

The L2 pool registers its memory once (`register_host_buffer`); every get/put then passes
addresses, so the transfer engine moves bytes straight between the pool and the segments.
Objects live in the memory segments that clients mount (`global_segment_size` of this
node's memory joins the cluster pool); an object stored in a node's segment vanishes with
that node.

Return codes of the client, measured here (0.3.13.post1, TCP, master on loopback):
- `batch_get_into`: bytes read (> 0); -704 OBJECT_NOT_FOUND for a missing key; -600
  INVALID_PARAMS when the buffer is smaller than the object (nothing copied); a larger buffer
  is fine and returns the object size.
- `batch_put_from` on a key already present returns 0 and keeps the old value; so this
  backend asks `batch_is_exist` first and reports PRESENT without moving the bytes again.
- `remove` right after an access returns -706 OBJECT_HAS_LEASE (lease ~5 s); `delete` uses
  `force=True` (safe: a reader racing a delete gets a miss or a checksum failure, never
  wrong bytes; a failed check is read once more, `reread_failed_checks`).
- Master killed: `health_check()` still returns 0 for a while (it answers from cached
  state), batch calls return -900 RPC_FAIL at once or block 4-13 s first; `setup()` against
  a missing master blocks ~90 s; `close()` blocks ~7 s. The transfer calls release the GIL,
  so they run in `BoundedCaller` threads under `storage.timeout_s`; `setup()` does not (the
  whole process froze for those 90 s, the bound's timer included), so `start` first checks
  that the master and an HTTP metadata server accept a connection (`storage.timeout_s` per
  address tried).
- Master restarted on the same port: the client reconnects by itself within ~1 s (the first
  put may return -200 NO_AVAILABLE_HANDLE before its segment is mounted again); objects
  held only in the old master's metadata are gone.
- A client killed (a daemon's crash): the master lists its objects until its `client_ttl`
  (10 s by default) lapses; `batch_is_exist` says 1, reads return -800 TRANSFER_FAIL, and a
  put of the key stores nothing (see `_dead_held`). A read racing a delete returns -703.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.config import MooncakeStorageConfig, redact_url
from hicache.endpoint import split_host_port
from hicache.errors import BackendUnavailable, InvalidArgument
from hicache.tiers.storage.base import MISSING, PutStatus, StorageBackend
from hicache.tiers.storage.integrity import write_headers

log = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
INVALID_PARAMS = -600
TRANSFER_FAIL = -800  # (a read of an object whose holder is gone)
# Codes that mean the master (or the transport to it) is gone, not a per-key problem.
UNREACHABLE = frozenset({-900, -901, -1010})
PROBE_KEY = "hicache-probe/does-not-exist"
UNREADABLE_KEYS = 65536  # keys remembered as listed but unreadable (`_unreadable`)
_char_at = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    # A read racing a forced delete (and a put that reuses the memory) returns torn bytes;
    # read again, it is a miss or the new object: not a corrupt one to remove (a racing
    # put's good copy would go with it). Seen in `test_threads_racing_on_the_same_keys_...`.
    reread_failed_checks = True
    # No chunking: measured here, cutting a 256-object batch into 128/64/32-object calls
    # lowered throughput (0.71x -> 0.58/0.49/0.39x of raw puts): each batch call has a fixed
    # cost, and the client's calls slow down while another thread runs Python (see
    # `_store_overlapped`), so there is no room for the checksums to hide in.
    pipeline_chunk = 1 << 20

    def __init__(self, cfg: MooncakeStorageConfig, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.cfg = cfg
        self._store: Any = None
        self._regions: list[tuple[int, int]] = []  # registered [start, end)
        # Keys the master lists but whose read failed in transfer: an object in a dead
        # client's segment (a daemon killed, for the master's client_ttl after) answers
        # "exists" to a put, which then stored nothing; the master drops it later, and
        # the page was lost though counted stored. A put replaces such a key (`_dead_held`).
        self._unreadable: OrderedDict[str, None] = OrderedDict()
        self._unreadable_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise BackendUnavailable(
                "mooncake: cannot import mooncake.store; install the "
                "'mooncake-transfer-engine-non-cuda' wheel (or the CUDA build on a GPU node) "
                f"and Debian's libibverbs1 librdmacm1 libnuma1 libcurl4 ({e})"
            ) from None
        c = self.cfg
        master = _host_port(c.master or "")
        if master is not None and not _loopback(master[0]) and _loopback(c.local_hostname):
            log.warning("mooncake: local_hostname %s with the master at %s: other nodes cannot "
                        "read the objects this node's segment holds; set "
                        "storage.mooncake.local_hostname to an address they reach",
                        c.local_hostname, c.master)
        self._check_reachable()
        log.info(
            "L3 mooncake backend: master=%s metadata_server=%s protocol=%s device=%r "
            "local_hostname=%s global_segment_size=%d local_buffer_size=%d timeout_s=%g",
            c.master,
            redact_url(c.metadata_server or "") or None,  # (it may hold a password)
            c.protocol,
            c.device,
            c.local_hostname,
            c.global_segment_size,
            c.local_buffer_size,
            self.timeout_s,
        )
        store = MooncakeDistributedStore()
        rc = self._caller.call(
            store.setup,
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device,
            c.master,
        )
        if rc != 0:
            raise BackendUnavailable(f"mooncake: setup() returned {rc} (master {c.master})")
        self._store = store
        self.register_host_buffer(self._canary_area.ctypes.data, self._canary_area.nbytes)

    def _check_reachable(self) -> None:
        """BackendUnavailable when the master or an HTTP metadata server does not accept a
        TCP connection (`setup` would hold the GIL ~90 s): within `timeout_s` for each
        address tried (a name may resolve to several; resolving it is not bounded), with
        the GIL free meanwhile. An HA master (`etcd://...`) is left to `setup`."""
        c = self.cfg
        targets = [("master", c.master, _host_port(c.master or ""))]
        if (c.metadata_server or "").startswith(("http://", "https://")):
            url = urllib.parse.urlsplit(c.metadata_server or "")
            try:
                port = url.port or (443 if url.scheme == "https" else 80)
            except ValueError as e:  # a port that is no number, or out of range
                raise BackendUnavailable(
                    f"mooncake: the metadata server {redact_url(c.metadata_server or '')} is not "
                    f"a valid URL ({e})"
                ) from None
            targets.append(("metadata server", redact_url(c.metadata_server or ""),
                            (url.hostname or "", port)))
        for what, shown, address in targets:
            if address is None or not address[0]:
                continue  # (a form this check cannot read: setup decides)
            try:
                socket.create_connection(address, timeout=self.timeout_s).close()
            except OSError as e:
                raise BackendUnavailable(
                    f"mooncake: the {what} {shown} does not accept connections ({e})"
                ) from None

    def close(self, wait_s: float = 0.0) -> bool:
        # A call given up on runs on in the client, and may still move data into
        # registered memory: the client is closed only once none runs (closing it under a
        # transfer could crash the process), and the caller learns whether one still does.
        deadline = time.monotonic() + wait_s
        idle = self._caller.wait_idle(wait_s)
        store, self._store = self._store, None
        if store is not None:
            if not idle:
                log.warning("mooncake: %d call(s) still running after %g s; the client is "
                            "left open under them", self._caller.running, wait_s)
            else:
                try:  # (the client takes seconds to close: the rest of `wait_s` if longer)
                    self._caller.call_within(max(self._caller.timeout_s, deadline - time.monotonic()),
                                             store.close)
                except BackendUnavailable as e:
                    log.warning("mooncake: close did not finish: %s", e)
                    idle = False
        return self._caller.close() and idle

    def register_host_buffer(self, address: int, size: int) -> None:
        if (address, address + size) in self._regions:
            return
        rc = self._caller.call(self.store.register_buffer, address, size)
        if rc != 0:
            raise BackendUnavailable(
                f"mooncake: register_buffer({address:#x}, {size}) returned {rc}"
            )
        self._regions.append((address, address + size))

    def unregister_host_buffer(self, address: int) -> None:
        region = next((r for r in self._regions if r[0] == address), None)
        if region is None:
            return
        try:
            rc = self._caller.call(self.store.unregister_buffer, address)
        except BackendUnavailable as e:  # (a call is stuck: the region stays registered)
            log.warning("mooncake: unregister_buffer(%#x) did not answer: %s", address, e)
            return
        self._regions.remove(region)  # (on an error code too: the client's state is unknown)
        if rc != 0:
            log.warning("mooncake: unregister_buffer(%#x) returned %d", address, rc)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """Registered host memory, [start, end) pairs."""
        return list(self._regions)

    @property
    def store(self) -> Any:
        if self._store is None:
            raise BackendUnavailable("mooncake: backend not started or closed")
        return self._store

    def _addresses(self, buffers: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
        # NOTE: per object on every get and put: `ctypes.c_char.from_buffer` gives the
        # address in ~0.3 µs where `ndarray.ctypes.data` takes ~1.3 µs.
        addrs, sizes = [], []
        regions = self._regions
        lo, hi = regions[-1] if regions else (0, 0)
        for buf in buffers:
            try:
                start = _addressof(_char_at(buf))  # type: ignore[arg-type]
            except TypeError:  # read-only buffer
                start = buf.ctypes.data
            end = start + buf.nbytes
            if not (lo <= start and end <= hi):
                region = next((r for r in regions if r[0] <= start and end <= r[1]), None)
                if region is None:
                    raise InvalidArgument(
                        "mooncake: buffer outside every registered region; call "
                        "register_host_buffer(pool_address, pool_size) first"
                    )
                lo, hi = region
            addrs.append(start)
            sizes.append(buf.nbytes)
        return addrs, sizes

    # ------------------------------------------------------------------ backend hooks

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return _present(self._caller.call(self.store.batch_is_exist, list(keys)))

    def _read_into(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[int]:
        addrs, sizes = self._addresses(buffers)
        codes = self._caller.call(self.store.batch_get_into, list(keys), addrs, sizes)
        _raise_if_unreachable("batch_get_into", codes)
        if all(code >= 0 for code in codes):  # all found: the sizes are the codes
            return list(codes)
        out: list[int] = []
        for key, code in zip(keys, codes, strict=True):
            if code >= 0:
                out.append(code)
            elif code == INVALID_PARAMS:
                # The stored object is larger than the buffer: report its real size so that
                # the caller counts it as corrupt.
                size = self._caller.call(self.store.get_size, key)
                out.append(size if size >= 0 else MISSING)
            else:
                if code != OBJECT_NOT_FOUND:
                    log.debug("mooncake: get %s returned %d; a miss", key, code)
                if code == TRANSFER_FAIL:
                    with self._unreadable_lock:
                        self._unreadable[key] = None
                        if len(self._unreadable) > UNREADABLE_KEYS:
                            self._unreadable.popitem(last=False)
                out.append(MISSING)
        return out

    def _write_from(self, keys: Sequence[str], buffers: Sequence[np.ndarray]) -> list[PutStatus]:
        addrs, sizes = self._addresses(buffers)
        return self._put_missing(keys, addrs, sizes, self._exists(keys))

    def _store_objects(
        self, keys: Sequence[str], buffers: Sequence[np.ndarray]
    ) -> list[PutStatus]:
        return self._guarded(self._store_overlapped, keys, buffers)

    def _store_overlapped(
        self, keys: Sequence[str], buffers: Sequence[np.ndarray]
    ) -> list[PutStatus]:
        """The existence check is a round trip to the master that holds no CPU here: the
        headers are written meanwhile (~0.4 and ~1.2 ms for 256 objects of 64 KiB here).

        NOTE: the check starts with `submit_started`. After a plain `submit` the worker
        needs the GIL to enter the client call, and the header loop (xxhash keeps the GIL
        for payloads up to 64 KiB) holds it until the loop ends: the round trip then
        followed the headers instead of hiding behind them. Pipelining chunks (headers of
        chunk k+1 during the put of chunk k) measured no faster on this 2-core machine:
        the transfer itself keeps a core busy and each extra call costs ~0.2-0.4 ms."""
        addrs, sizes = self._addresses(buffers)
        probe = self._caller.submit_started(self.store.batch_is_exist, list(keys))
        write_headers(buffers, keys)
        return self._put_missing(keys, addrs, sizes, _present(self._caller.result(probe)))

    def _put_missing(
        self, keys: Sequence[str], addrs: list[int], sizes: list[int], present: list[bool]
    ) -> list[PutStatus]:
        if self._unreadable:
            present = self._dead_held(keys, present)
        todo = [i for i, p in enumerate(present) if not p]
        out = [PutStatus.PRESENT] * len(keys)
        if not todo:
            return out
        codes = self._caller.call(
            self.store.batch_put_from,
            [keys[i] for i in todo],
            [addrs[i] for i in todo],
            [sizes[i] for i in todo],
        )
        _raise_if_unreachable("batch_put_from", codes)
        for i, code in zip(todo, codes, strict=True):
            if code == 0:
                out[i] = PutStatus.STORED
            elif code == OBJECT_ALREADY_EXISTS:
                out[i] = PutStatus.PRESENT
            else:
                self._warn.warning(f"put-{code}", "mooncake: put %s returned %d", keys[i], code)
                out[i] = PutStatus.FAILED
        return out

    def _dead_held(self, keys: Sequence[str], present: list[bool]) -> list[bool]:
        """`present`, less the keys whose object a dead client holds: listed, their last
        read failed in transfer, and a read now fails again (one that reads is another's
        sound object, read by others too: never removed). Those are removed (forced: the
        holder is gone) to be put again."""
        with self._unreadable_lock:
            marked = [i for i, p in enumerate(present) if p and keys[i] in self._unreadable]
            for i in marked:
                del self._unreadable[keys[i]]
        dead = [i for i in marked if not self._caller.call(self.store.get, keys[i])]
        if not dead:
            return present
        codes = self._caller.call(self.store.batch_remove, [keys[i] for i in dead], True)
        _raise_if_unreachable("batch_remove", codes)
        out = list(present)
        for i, code in zip(dead, codes, strict=True):
            if code == 0 or code == OBJECT_NOT_FOUND:
                out[i] = False
        log.info("mooncake: %d listed objects of a client gone are written again",
                 sum(1 for i in dead if not out[i]))
        return out

    def _remove(self, keys: Sequence[str]) -> int:
        codes = self._caller.call(self.store.batch_remove, list(keys), True)
        _raise_if_unreachable("batch_remove", codes)
        return sum(1 for code in codes if code == 0)

    def _probe(self) -> tuple[str, int | None, int | None]:
        rc = self._caller.call(self.store.health_check)
        if rc != 0:
            reason = {1: "client not initialised or closed", 2: "master unreachable"}
            raise BackendUnavailable(f"mooncake: health_check() = {rc} ({reason.get(rc, '?')})")
        # health_check() answers from cached state for a while after the master died;
        # one real RPC tells the truth.
        self._exists([PROBE_KEY])
        detail = f"mooncake master {self.cfg.master} ok"
        return detail, self.cfg.global_segment_size, None


def _present(codes: Sequence[int]) -> list[bool]:
    """`batch_is_exist` codes as presence; a negative code means the store failed."""
    if any(code < 0 for code in codes):
        raise BackendUnavailable(f"mooncake: batch_is_exist failed ({_first_error(codes)})")
    return [code == 1 for code in codes]


def _first_error(codes: Sequence[int]) -> int:
    return next(code for code in codes if code < 0)


def _raise_if_unreachable(op: str, codes: Sequence[int]) -> None:
    bad = [code for code in codes if code in UNREACHABLE]
    if bad:
        raise BackendUnavailable(f"mooncake: {op} failed with {bad[0]} (master unreachable)")


def _host_port(address: str) -> tuple[str, int] | None:
    """`host:port` (IPv6 as `[addr]:port`) as a socket address, by the daemon's own rule
    (`split_host_port`); None for another form (an HA master as `etcd://h1:2379;h2:2379`,
    which Mooncake resolves through etcd)."""
    host_port = split_host_port(address)
    return None if host_port is None else (host_port[0].strip("[]"), host_port[1])


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
