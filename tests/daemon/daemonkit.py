"""A real `hicache serve` process for the daemon tests, and small helpers around it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from hicache.bench.services import free_port as free_port  # the daemon tests take it from here
from hicache.client import Client
from hicache.errors import HicacheError

if TYPE_CHECKING:
    from hicache.bench.oracle import KvOracle

PAGE = 64  # model.page_size of the embedded config
# Tiny sizes: L1 16 pages of 64 KiB (4 layers x 16 KiB), L2 32 pages.
TINY = (
    "tiers.l1.tokens=1024",
    "tiers.l2.reserve_gb=0",
    "server.max_tokens_per_request=8192",
    "metrics.port=0",
)
# A hybrid model with every component and a sidecar anchored on each (page 4).
FULL_SWA_MAMBA = (
    "model.page_size=4",
    "model.components={full: {layers: 2, bytes_per_token_per_layer: 8},"
    " swa: {layers: 3, bytes_per_token_per_layer: 4, window_tokens: 8},"
    " mamba: {layers: 2, state_bytes_per_layer: 64}}",
    "model.sidecars={idx: {anchor: full, layers: 1, bytes_per_token_per_layer: 2},"
    " swaside: {anchor: swa, layers: 2, bytes_per_token_per_layer: 4},"
    " conv: {anchor: mamba, layers: 1, state_bytes_per_layer: 32}}",
)


def tokens(n: int, start: int = 1) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


def kv_pattern(seed: int, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes an engine writes for one page of one layer (deterministic per seed)."""
    return np.random.default_rng([seed, layer]).integers(0, 256, page_bytes, dtype=np.uint8)


class Daemon:
    """`hicache serve` as a subprocess on a private socket (or a TCP address)."""

    def __init__(self, workdir: Path, *sets: str, listen: str | None = None,
                 ca: bytes | None = None, config: Path | None = None) -> None:
        """`ca`: the PEM root certificate its clients trust (a TLS daemon); `config`: the
        YAML file it reads (`--config`), the `sets` applied over it."""
        self.workdir = workdir
        self.ca = ca
        self.config = config
        self.socket = workdir / "d.sock"
        self.listen = listen or f"unix://{self.socket}"
        self.sets = (*TINY, *sets)
        self.log_path = workdir / f"daemon-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return self.listen

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "hicache.cli", "serve", "--listen", self.listen]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        for item in self.sets:
            argv += ["--set", item]
        return argv

    def start(self, wait: bool = True) -> Daemon:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with Client(self.target, retries=0, timeout_s=1.0, root_certificates=self.ca) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
                try:
                    if probe.serving():
                        return
                except HicacheError:
                    time.sleep(0.05)
        raise AssertionError(f"daemon not ready in {timeout_s} s:\n{self.log()}")

    def client(self, **kwargs: object) -> Client:
        kwargs.setdefault("root_certificates", self.ca)
        return Client(self.target, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        """Stop the daemon like an operator would (SIGTERM: it unlinks its shared memory);
        one that does not exit in time is killed and its segments removed here, so test
        runs leave nothing in /dev/shm."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.stop(signal.SIGTERM, timeout_s=15.0)
            except subprocess.TimeoutExpired:
                self.stop(signal.SIGKILL)
        for leftover in Path("/dev/shm").glob(f"hicache-*-{self.proc.pid}-*"):
            leftover.unlink(missing_ok=True)


def eventually(check: Callable[[], bool], timeout_s: float = 15.0, poll_s: float = 0.02) -> bool:
    """Whether `check()` comes true within `timeout_s` (asked every `poll_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_s)
    return check()


def run_cli(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def rpc_count(port: int, method: str, code: str, series: str = "count") -> float:
    """`hicache_rpc_seconds_count` (or `series` "sum": their seconds) of `method` (e.g.
    "hicache.v1.HiCache/MatchPrefix") ending with `code`, 0 when there is none."""
    for line in scrape(port).splitlines():
        if line.startswith(f"hicache_rpc_seconds_{series}{{") and f'method="{method}"' in line \
                and f'code="{code}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ser(message: Any) -> bytes:
    """A protobuf message's bytes (the raw calls' request serializer)."""
    return bytes(message.SerializeToString())


@contextlib.contextmanager
def raw_calls(target: str, method: str, reply: Callable[[bytes], Any], stream: bool = False,
              ) -> Iterator[Callable[[Iterator[Any]], Any]]:
    """A plaintext channel calling `method` (e.g. "/hicache.v1.HiCache/MatchPrefix") with
    a request stream the test controls: `call(messages)` starts a call (no deadline)
    sending what `messages` yields (a future; for `stream`, the reply iterator). The
    calls are cancelled at the end."""
    channel = grpc.insecure_channel(target)
    made: list[Any] = []
    make = channel.stream_stream if stream else channel.stream_unary
    multi = make(method, request_serializer=ser, response_deserializer=reply)

    def call(messages: Iterator[Any]) -> Any:
        c = multi(messages) if stream else multi.future(messages)
        made.append(c)
        return c

    try:
        yield call
    finally:
        for c in made:
            c.cancel()
        channel.close()


def never(stop: threading.Event) -> Iterator[Any]:
    """A request stream whose message never comes (until `stop`, then none: it ends)."""
    stop.wait()
    yield from ()


@contextlib.contextmanager
def half_sent(target: str, method: str, reply: Callable[[bytes], Any]) -> Iterator[Callable[[], Any]]:
    """`start()` begins a call on `target` that sends its headers and never its message
    (until the block ends: then its caller half-closes); the calls are cancelled at the end."""
    stop = threading.Event()
    with raw_calls(target, method, reply) as call:
        try:
            yield lambda: call(never(stop))
        finally:
            stop.set()


class Aborted(Exception):
    """What `StandInContext.abort` raises (gRPC's own ends the call)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details


class StandInContext:
    """A servicer context of one call, for the interceptor driven in-process: records a
    cancel (it has no `_rpc_event`, so the interceptor's `_cancel` falls back to `cancel`)
    and raises `Aborted` on `abort`."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def load_and_verify(c: Client, oracle: KvOracle, prompt: bytes, page: int = PAGE) -> int:
    """Match `prompt`, Load its L2 part, check every reused page's bytes against `oracle`
    (no wrong byte, none missing); the tokens reused."""
    with c.matched(prompt) as hit:
        reused, pages = hit.device_tokens, hit.device_pages
        if hit.host_tokens:
            last = list(c.load(hit.lock_id))[-1]
            assert last.device_pages is not None and last.device_tokens is not None
            reused, pages = last.device_tokens, last.device_pages
        before = oracle.pages_checked
        oracle.verify(prompt, pages, reused // page)
        assert oracle.pages_checked > before or reused == 0
    assert oracle.wrong_bytes == 0 and oracle.pages_missing == 0
    return reused


def computed_into_l3(c: Client, oracle: KvOracle, prompt: bytes, page: int = PAGE) -> None:
    """An engine's request for `prompt`: its KV written by `oracle` into the allocation,
    inserted, then flushed down to L3."""
    m = c.match(prompt, lock=True, allocate_tokens=len(prompt) // 4)
    oracle.write(prompt, m.pages, start_page=m.device_tokens // page)
    c.insert(prompt, lock_id=m.lock_id, allocation_id=m.allocation_id)
    c.flush(timeout_s=10)


def stored(store: Callable[[bytes], None], c: Client, pages: int, start: int) -> bytes:
    """A prompt of `pages` pages that `store` (another daemon's engine: `computed_into_l3`)
    stored, known to `c`'s daemon as in L3 only."""
    prompt = tokens(pages * PAGE, start=start)
    store(prompt)
    m = c.match(prompt)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, pages * PAGE)
    return prompt


def pool(c: Client, tier: str) -> tuple[int, int]:
    """(used_pages, locked_pages) of the single-member pool of `tier` ("device" / "host")."""
    (p,) = [p for p in c.stats().pools if p.tier == tier]
    return p.used_pages, p.locked_pages
