"""Log records that repeat once per event, at most once per key per interval.

Some warnings are raised per event, and the events come in floods exactly when something
is wrong: a backup given up per insert while the L3 circuit breaker is open (hundreds a
second), a put refused per object by a full Redis, a corrupt object per page of a store
full of junk. `ThrottledLog` writes the first record of a key, holds back the ones that
follow within `interval_s` (counting them), and adds the count to the next record of that
key that passes: "(and 312 more like it in the last 10 s)". The events themselves are
counted in the metrics, so nothing but log volume is given up.

NOTE: a held-back count is reported only by the next record of its key; when the flood
ends, the last window's count stays unsaid (the metrics have it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 1024  # keys name call sites and error types: few; bounded all the same


class ThrottledLog:
    """Per-key throttle in front of one logger (thread-safe)."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        # key -> [time of the last record written, records held back since]
        self._keys: OrderedDict[str, list[float]] = OrderedDict()
        self._mu = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: object = None) -> bool:
        """Write the record unless one of `key` was written less than `interval_s` ago;
        returns whether it was written."""
        if not self.logger.isEnabledFor(level):
            return False
        with self._mu:
            now = self._clock()
            entry = self._keys.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return False
            held, since = (int(entry[1]), entry[0]) if entry is not None else (0, now)
            self._keys[key] = [now, 0]
            self._keys.move_to_end(key)
            while len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)
        if held:
            self.logger.log(level, "%s (and %d more like it in the last %.0f s)",
                            msg % args if args else msg, held, now - since,
                            exc_info=exc_info)  # type: ignore[arg-type]
        else:
            self.logger.log(level, msg, *args, exc_info=exc_info)  # type: ignore[arg-type]
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object, exc_info: object = None) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)
