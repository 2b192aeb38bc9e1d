"""The daemon process: configuration -> tree and pools -> services, until a signal."""

from __future__ import annotations

import logging
import signal
import threading

from hicache.config import HicacheConfig

log = logging.getLogger("hicache.server")


def serve(cfg: HicacheConfig, stop: threading.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set); return the process exit code."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info(
        "hicache daemon up: model=%s page_size=%d members=%s l1_pages=%d listen=%s",
        cfg.model.id,
        cfg.model.page_size,
        ",".join(m.name for m in cfg.model.members),
        cfg.l1_pages,
        cfg.server.listen,
    )
    stop.wait()
    log.info("hicache daemon stopped")
    return 0
