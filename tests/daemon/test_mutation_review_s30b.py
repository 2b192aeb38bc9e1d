"""Mutation review, second round (daemon): how often the daemon looks for calls whose
request message never came, which no other test pinned; names the mutant it kills."""

from __future__ import annotations

import pytest

from hicache.auth import Authenticator
from hicache.interceptor import ServerInterceptor


@pytest.mark.parametrize(("timeout_s", "check_s"), [(2.0, 0.5), (0.1, 0.05), (10.0, 1.0)])
def test_message_reads_are_checked_four_times_per_timeout_within_bounds(timeout_s, check_s) -> None:
    """`read_check_s` (the period of `expire_reads`) is a quarter of
    `server.message_timeout_s`, kept within 0.05-1 s: a caller that stops mid-send is
    cancelled at most a quarter of the timeout late (2 s -> every 0.5 s).
    Mutant killed: `read_check_s` of the whole timeout (2 s -> every 1 s: a stalled
    read held up to twice its timeout)."""
    interceptor = ServerInterceptor(Authenticator([]), None, message_timeout_s=timeout_s)
    assert interceptor.read_check_s == check_s
