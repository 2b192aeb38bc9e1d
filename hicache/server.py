"""The daemon process: configuration -> controller -> gRPC services, until SIGTERM.

`serve(cfg)` is `hicache serve`: it takes the socket lock, builds and starts the
controller, then runs a `Daemon` (the gRPC server, the probe listener, metrics and the
housekeeping loops) until SIGTERM/SIGINT. Shutdown order: health says NOT_SERVING, the
server stops accepting and finishes in-flight calls (`STOP_GRACE_S`), the controller
flushes write-back data to L3 within `server.shutdown_flush_s`, then closes (unlinking the
shared memory); the socket file is removed and the process exits 0.

Server model: the synchronous `grpc.server` over a thread pool. Measured here (2 cores,
unix socket, one trivial unary handler, sync vs `grpc.aio` servers): p50 555-597 µs vs
598-658 µs with one client, 1.4-1.9k vs 1.5-1.8k calls/s with 8 client processes: the same
within noise. The core is synchronous and thread-safe, so aio would only add an executor
hop per call (its handlers must not block the event loop).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from hicache.auth import Authenticator
from hicache.config import MAX_MESSAGE_BYTES, HicacheConfig
from hicache.controller.base import CacheService
from hicache.endpoint import Endpoint, SocketLock, parse_address
from hicache.errors import FailedPrecondition
from hicache.interceptor import ServerInterceptor
from hicache.metrics import Metrics
from hicache.pb.hicache.v1 import admin_pb2, admin_pb2_grpc, hicache_pb2, hicache_pb2_grpc
from hicache.reload import Reloader, ReloadOutcome
from hicache.server_pool import ServerPool
from hicache.service import AdminServicer, HiCacheServicer
from hicache.signals import watch_hangups, watch_stack_dumps
from hicache.tls import ServerCertificate

log = logging.getLogger("hicache.server")

HICACHE_SERVICE = hicache_pb2.DESCRIPTOR.services_by_name["HiCache"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
WORKERS = 32  # server threads started with the daemon (`hicache.server_pool`)
# ... and as many more as calls need, up to this many in all (the probe listener's too, 2
# started): a call waiting for its request message (a slow or stopped sender, for up to
# `server.message_timeout_s`) holds a thread, and calls that come meanwhile must find one.
MAX_WORKERS = 256
MAX_HEALTH_WATCHES = 4  # per listener, at most this many server threads held by health Watch streams
MAX_REFLECTION_STREAMS = 2  # ... and by server reflection streams
STOP_GRACE_S = 5.0
STOP_SLACK_S = 1.0  # how long past the grace period a stop waits for gRPC's own end
SIGNAL_POLL_S = 0.2  # how often the main thread wakes to run a signal's handler
HEALTH_REFRESH_S = 1.0

CoreFactory = Callable[[HicacheConfig, str], CacheService]


def check_security(cfg: HicacheConfig, endpoint: Endpoint) -> None:
    """Plaintext TCP only on loopback: anything else needs TLS."""
    if endpoint.is_unix or endpoint.is_loopback or cfg.server.tls_cert is not None:
        return
    raise FailedPrecondition(
        f"server.listen={endpoint.address} is not a loopback address: TCP on it requires TLS "
        f"(set server.tls_cert and server.tls_key) or listen on 127.0.0.1 / a unix socket"
    )



class HealthServicer(health.HealthServicer):
    """The standard grpc.health.v1 service, whose NOT_FOUND for a service it does not
    know says so (the library's carries no message; every status here says what was
    wrong), and which serves at most `max_watches` Watch streams at once: each holds a
    server thread for its life (the sync server runs the library's blocking watcher), and
    Watch needs no token, so 32 of them from anyone who can connect stalled every call."""

    def __init__(self, max_watches: int = MAX_HEALTH_WATCHES) -> None:
        super().__init__(experimental_non_blocking=False)
        self._max_watches = max_watches
        self._watch_slots = threading.BoundedSemaphore(max_watches)

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:
        # (served through the interceptor, always in the blocking form: a thread a stream)
        if not self._watch_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"grpc.health.v1: at most {self._max_watches} Watch streams at once "
                          "(each holds a server thread); poll with Check instead")
        try:
            watcher = super().Watch(request, context)
        except BaseException:
            self._watch_slots.release()
            raise
        return self._released_at_end(watcher)

    def _released_at_end(self, watcher: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from watcher
        finally:
            self._watch_slots.release()

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = super().Check(request, context)
        if context.code() is grpc.StatusCode.NOT_FOUND and not context.details():
            context.set_details(f"grpc.health.v1: no service named {request.service[:200]!r} "
                                "(the empty name is the daemon's overall status)")
        return response


class ReflectionServicer(reflection.ReflectionServicer):
    """Server reflection serving at most `max_streams` streams at once: each is a
    bidirectional stream holding a server thread until its client closes it, so 40 idle
    ones (from anyone who can connect) stalled every call, health checks included."""

    def __init__(self, service_names: tuple[str, ...],
                 max_streams: int = MAX_REFLECTION_STREAMS) -> None:
        super().__init__(service_names)
        self._max_streams = max_streams
        self._slots = threading.BoundedSemaphore(max_streams)

    def ServerReflectionInfo(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"server reflection: at most {self._max_streams} streams at once "
                          "(each holds a server thread); close one first")
        return self._released_at_end(super().ServerReflectionInfo(request_iterator, context))

    def _released_at_end(self, replies: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from replies
        finally:
            self._slots.release()


class Daemon:
    """The gRPC side of a running daemon over a started core."""

    def __init__(self, cfg: HicacheConfig, core: CacheService, endpoint: Endpoint,
                 load: Callable[[], HicacheConfig] | None = None) -> None:
        """`load`: reads the configuration again, for `reload` (SIGHUP)."""
        self.cfg = cfg
        self.core = core
        self.endpoint = endpoint
        self.metrics = Metrics(core)
        self.health = HealthServicer()
        # The probe listener's: the same statuses (`_refresh_health`), its own Watch streams (it
        # answers anyone who reaches its port: they must not take the main listener's).
        self.probe_health = HealthServicer()
        self._stop = threading.Event()
        self._reads_stop = threading.Event()
        self._reads: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self._lease_period_s = cfg.server.lease_ms / 3e3  # (the client heartbeats as often)
        self._last_lease_sweep = time.monotonic()
        options = [
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            # A reply lists page ids of every member (at page size 1 it outgrows the
            # request), a Batch's those of all its ops: gRPC's own limit, which a Batch
            # keeps within op by op (`HiCacheServicer._run_batch`).
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second daemon must not share the port
        ]
        self.auth = Authenticator(cfg.server.tokens)
        self.certificate = (
            ServerCertificate(cfg.server.tls_cert, cfg.server.tls_key)
            if endpoint.path is None and cfg.server.tls_cert is not None
            and cfg.server.tls_key is not None else None
        )
        self._reloader = (Reloader(cfg, load, self.auth, self.certificate)
                          if load is not None else None)
        self.interceptor = ServerInterceptor(self.auth, self.metrics.rpc,
                                             cfg.server.message_timeout_s)
        self._pool = ServerPool(WORKERS, MAX_WORKERS, "rpc").start()
        self._probe_pool: ServerPool | None = None
        self.server = grpc.server(
            self._pool,
            interceptors=[self.interceptor],
            options=options,
        )
        hicache_pb2_grpc.add_HiCacheServicer_to_server(
            HiCacheServicer(core, cfg.server.max_tokens_per_request, cfg.max_reply_bytes), self.server
        )
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(core, cfg.server.shutdown_flush_s), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            ReflectionServicer(
                (HICACHE_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
            ),
            self.server,
        )
        self.probe_server: grpc.Server | None = None
        # (the probe listener answers health checks to anyone who reaches its port: its
        # calls' messages are bounded alike, and its pool grows the same way)
        self.probe_interceptor = ServerInterceptor(Authenticator(()), None, cfg.server.message_timeout_s,
                                                   listener="probe listener")
        self.metrics_port = 0

    def start(self) -> None:
        self._bind()
        self._refresh_health()
        self.server.start()
        if self.endpoint.path is not None:
            os.chmod(self.endpoint.path, self.cfg.server.socket_mode_bits)
        if self.cfg.server.probe_listen:
            self._probe_pool = ServerPool(2, MAX_WORKERS, "probe").start()
            self.probe_server = grpc.server(
                self._probe_pool,
                interceptors=[self.probe_interceptor],
                options=[("grpc.so_reuseport", 0)],
            )
            health_pb2_grpc.add_HealthServicer_to_server(self.probe_health, self.probe_server)
            probe = self.cfg.server.probe_listen
            if not _bound(lambda: self.probe_server.add_insecure_port(probe)):  # type: ignore[union-attr]
                raise FailedPrecondition(f"server.probe_listen={probe}: cannot listen there (in use?)")
            self.probe_server.start()
        try:
            self.metrics_port = self.metrics.serve(self.cfg.metrics.port)
        except OSError as e:
            raise FailedPrecondition(
                f"metrics.port={self.cfg.metrics.port}: cannot serve metrics there ({e.strerror}; "
                "another daemon on this node? give each its own port, or 0 to turn them off)"
            ) from None
        self._every("leases", self._lease_period_s, self._sweep_leases)
        self._every("health", HEALTH_REFRESH_S, self._refresh_health)
        # (until the probe listener stops, the stop's last step: it serves through the flush)
        self._reads = self._every("reads", self.interceptor.read_check_s, self._expire_reads,
                                  until=self._reads_stop)

    def _bind(self) -> None:
        target = self.endpoint.target
        if self.endpoint.path is not None:
            # Create the socket file without group/other access; chmod sets the final mode.
            old = os.umask(0o177)
            try:
                port = _bound(lambda: self.server.add_insecure_port(target))
            finally:
                os.umask(old)
        elif self.certificate is not None:
            creds = self.certificate.credentials()
            port = _bound(lambda: self.server.add_secure_port(target, creds))
        else:
            port = _bound(lambda: self.server.add_insecure_port(target))
        if not port:
            raise FailedPrecondition(
                f"server.listen={self.endpoint.address}: cannot listen there (in use? for TLS: "
                "do server.tls_cert and tls_key hold a matching PEM certificate and key?)"
            )

    def reload(self) -> ReloadOutcome:
        """Read the configuration again and apply what can change live (`hicache.reload`)."""
        if self._reloader is None:
            log.warning("reload asked for, but this daemon has no configuration source to read again")
            return ReloadOutcome(error="no configuration source")
        outcome = self._reloader.reload()
        self.metrics.reloads.observe(outcome.ok)
        return outcome

    def _sweep_leases(self) -> None:
        """Expire lapsed leases, not counting time this process did not run: a sweep
        more than a period late means it was stopped (SIGSTOP, a paused VM, swapped out),
        and the engines could not renew meanwhile (a 4.5 s stop dropped every live
        engine's locks and allocations, whose KV they went on writing)."""
        now = time.monotonic()
        stalled = now - self._last_lease_sweep - 2 * self._lease_period_s
        self._last_lease_sweep = now
        self.core.expire_leases(stalled_s=max(0.0, stalled))

    def _refresh_health(self) -> None:
        if self._stop.is_set():
            return
        overall = self.core.serving()
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        # Overall (readiness): NOT_SERVING while a required backend is down. The services
        # themselves (liveness) keep SERVING: L1/L2 still work.
        for health_servicer in (self.health, self.probe_health):
            health_servicer.set("", serving if overall else not_serving)
            health_servicer.set(HICACHE_SERVICE, serving)
            health_servicer.set(ADMIN_SERVICE, serving)

    def _expire_reads(self) -> None:
        self.interceptor.expire_reads()
        self.probe_interceptor.expire_reads()

    def _every(self, name: str, interval_s: float, fn: Callable[[], object],
               until: threading.Event | None = None) -> threading.Thread:
        """Run `fn` every `interval_s` on a thread of its own, until `until` (default: the
        stop's first step; the stop joins those threads)."""
        stop = self._stop if until is None else until

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    fn()
                except Exception:  # housekeeping must outlive one failure
                    log.exception("%s loop failed", name)

        thread = threading.Thread(target=loop, name=f"hicache-{name}", daemon=True)
        thread.start()
        if until is None:
            self._threads.append(thread)
        return thread

    def stop(self) -> None:
        """Stop accepting, finish in-flight calls, flush, close the core."""
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.probe_health.enter_graceful_shutdown()  # (the probe listener answers NOT_SERVING)
        # Calls that come from now on are refused UNAVAILABLE (the contract: gRPC's stop
        # would cancel them), those under way finish within the grace period; then gRPC
        # stops. Bounded: a call gRPC never finished (it happened: see the interceptor's
        # streaming requests) must not keep the flush and the exit waiting forever.
        self.interceptor.begin_stop()
        self.probe_interceptor.begin_stop()  # (its calls waiting for a message end now)
        started = time.monotonic()
        self.interceptor.wait_idle(STOP_GRACE_S)
        left = max(0.0, STOP_GRACE_S - (time.monotonic() - started))
        if not self.server.stop(left).wait(left + STOP_SLACK_S):
            log.warning("gRPC server not stopped %.0f s after its grace period; going on",
                        STOP_SLACK_S)
        self._pool.shutdown(wait=False)  # (its threads end once their calls have)
        for thread in self._threads:
            thread.join(timeout=5)
        self.metrics.close()
        try:
            try:
                written = self.core.flush(self.cfg.server.shutdown_flush_s)
                log.info("flushed %d pages to L3", written)
                if left := self.core.unflushed_pages():
                    log.warning("%d pages L3 lacks were not flushed (L3 down, or the %.0f s of "
                                "server.shutdown_flush_s passed): they leave with this daemon",
                                left, self.cfg.server.shutdown_flush_s)
            except Exception:
                log.exception("shutdown flush failed; closing anyway")
            self.core.close()
        finally:
            if self.probe_server is not None:
                # Last: kubelet probes see NOT_SERVING, not a refused connection, until
                # the flush is done (a refused liveness probe counts toward a restart).
                self.probe_server.stop(0)
            if self._probe_pool is not None:
                self._probe_pool.shutdown(wait=False)
            self._reads_stop.set()
            if self._reads is not None:
                self._reads.join(timeout=5)


def longest_stop_s(cfg: HicacheConfig) -> float:
    """How long a SIGTERM can take to exit: in-flight calls (`STOP_GRACE_S`, and at most
    `STOP_SLACK_S` more for gRPC's own end), the flush to
    L3 (`server.shutdown_flush_s`), then closing, which waits for the L3 calls under way
    (`close_wait_s`: `storage.timeout_s` + 5 s, one deadline for every thread; a hung
    store takes that long). A supervisor's stop timeout (systemd's TimeoutStopSec, a pod's
    terminationGracePeriodSeconds) must exceed it, or the daemon is killed before it
    unlinks its shared memory (the next start then removes it)."""
    from hicache.controller.controller import close_wait_s

    return STOP_GRACE_S + STOP_SLACK_S + cfg.server.shutdown_flush_s + close_wait_s(cfg)


def _default_core(cfg: HicacheConfig, instance: str) -> CacheService:
    from hicache.controller.controller import build_controller

    return build_controller(cfg, instance)  # started


def serve(
    cfg: HicacheConfig,
    stop: threading.Event | None = None,
    core_factory: CoreFactory = _default_core,
    load: Callable[[], HicacheConfig] | None = None,
    hangups: list[int] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set); return the process exit code. SIGHUP
    reloads the configuration through `load` (`hicache.reload`); it never stops the
    daemon. `hangups`: the SIGHUPs `hicache.signals.watch_hangups` noted before (the
    process's start), one reload once ready. Raises `FailedPrecondition` (with a message for the operator) when
    it cannot start."""
    endpoint = parse_address(cfg.server.listen)
    check_security(cfg, endpoint)
    stop = stop or threading.Event()
    # Python runs a signal's handler on the main thread, and only once that thread runs:
    # asleep in an untimed wait, it did not when the signal reached another thread (a
    # SIGTERM went unheeded until a second one came 30 s later, once in a suite run beside
    # busy loops; 1 of 15 stops in a stress run), so it wakes every SIGNAL_POLL_S. The
    # handler takes no lock: Event.set() there could wait for the lock the main thread
    # holds inside Event.wait().
    signalled: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: signalled.append(signum))
        hangups = watch_hangups(hangups)  # (see hicache.signals)
        watch_stack_dumps()
    hangups = [] if hangups is None else hangups
    lock = SocketLock(endpoint.path) if endpoint.path is not None else None
    if lock is not None:
        lock.acquire()
    try:
        core = core_factory(cfg, endpoint.instance_name())
        try:
            daemon = Daemon(cfg, core, endpoint, load)
        except BaseException:
            core.close()  # its pools (L1 shared memory) must not outlive the attempt
            raise
        # Before serving: the collection it starts with holds the GIL for ~0.1 s.
        frozen = freeze_startup_heap()
        try:
            daemon.start()
        except BaseException:
            daemon.stop()
            raise
        log.info(
            "hicache daemon ready: listen=%s model=%s page_size=%d members=%s metrics_port=%d "
            "gc_frozen=%d",
            endpoint.address,
            cfg.model.id,
            cfg.model.page_size,
            ",".join(m.name for m in cfg.model.members),
            daemon.metrics_port,
            frozen,
        )
        reloading: threading.Thread | None = None
        while not signalled and not stop.wait(SIGNAL_POLL_S):
            # A reload runs apart: one stuck reading a file (a hung mount) must not keep
            # the main thread from a stop. One at a time; several SIGHUPs meanwhile are
            # one more (it reads the latest files). None once a stop is asked for.
            if hangups and not signalled and (reloading is None or not reloading.is_alive()):
                hangups.clear()
                reloading = threading.Thread(target=daemon.reload, name="reload", daemon=True)
                try:
                    reloading.start()
                except RuntimeError as e:  # (a limit on threads or memory, reached now)
                    log.error("reload not done: cannot start its thread (%s); send SIGHUP again "
                              "once the limit on threads or memory allows", e)
                    reloading = None
        log.info("hicache daemon stopping")
        daemon.stop()
    finally:
        if lock is not None:
            lock.release()
    log.info("hicache daemon stopped")
    return 0


def freeze_startup_heap() -> int:
    """Move every object alive once the daemon is built (the imported libraries, the config,
    the pools: ~180,000 objects here, nearly all of them torch's and grpc's) out of the
    cyclic garbage collector's reach, and return how many there are. They live as long as
    the process, yet a full collection walked them all: 85-100 ms with the GIL held, every
    RPC stalled. Python runs one once the objects that reached its oldest generation since
    the last exceed a quarter of those already there: rare while the tree's nodes die by
    reference counting (none in 15,000 bench rounds), sooner with many long-lived
    sessions, prefetches or handles. Frozen, a full collection walks only what came after
    (2 ms after 3,000 bench rounds)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _bound(add_port: Callable[[], int]) -> int:
    """The port `add_port` bound, or 0: grpcio raises RuntimeError where it cannot bind
    (an address in use, a bad key pair) instead of returning 0."""
    try:
        return add_port()
    except RuntimeError:
        return 0


