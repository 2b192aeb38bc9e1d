"""Mutation review (session 30): behaviour no test pinned until now.

Each test here was written against a mutant of the product code that the rest of the
suite let through (a bound moved by one, a check dropped, a counter wired to the wrong
figure); the mutant is named in the test's docstring. Every test passes on the product
as it is and fails under its mutant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent / "controller"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "tiers" / "storage"))

from engine_sim import Engine, built_controllers, evict_all, flushed, prefetch_back, seq
from storage_pages import Pool, storage_config

from hicache import service
from hicache.bench.services import RedisServer
from hicache.config import MemberSpec, load_config
from hicache.controller.base import (
    AttachInfo,
    InsertRequest,
    LoadProgress,
    MatchOutcome,
    MatchRequest,
    PrefetchState,
    StatsSnapshot,
)
from hicache.controller.workers import CircuitBreaker
from hicache.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from hicache.interceptor import MAX_STATUS_MESSAGE, status_of
from hicache.keys import CANARY_PREFIX
from hicache.metrics import counter_families
from hicache.pb.hicache.v1 import admin_pb2 as apb
from hicache.reply_checks import ReplyBounds
from hicache.tiers.base import PoolDescriptor, PoolKind
from hicache.tiers.storage import PutStatus, build_backend
from hicache.types import ComponentKind, StorageBackendName, Tier

FULL = ComponentKind.FULL
PS = 4  # tokens per page (the reply-check geometry and engine_sim's tiny_config)


# ----------------------------------------------------------------- client reply checks


def _bounds(num_pages: int = 8) -> ReplyBounds:
    """What a client attached to one FULL member of `num_pages` pages checks replies by."""
    member = MemberSpec("full", FULL, FULL, layers=2, bytes_per_page_per_layer=64, window_tokens=0)
    pool = PoolDescriptor(member="full", kind=PoolKind.SHM, handle=b"seg", device=-1,
                          num_pages=num_pages, layer_stride_bytes=num_pages * 64,
                          page_stride_bytes=64, layers=2)
    return ReplyBounds(AttachInfo(page_size=PS, members=(member,), pools=(pool,), lease_ms=1000))


def _ids(*ids: int) -> dict[str, np.ndarray]:
    return {"full": np.asarray(ids, dtype=np.int64)}


def test_a_match_with_a_negative_token_count_is_refused() -> None:
    """Mutant: `n < 0 or n % ps` -> `n % ps` (reply_checks.match). A reply saying
    host_tokens=-4 is a whole number of pages and lowers the sum under the prompt: the
    engine would count device_tokens + host_tokens = 4 tokens reused where 8 are."""
    bounds = _bounds()
    sane = MatchOutcome(device_tokens=2 * PS, host_tokens=0, storage_tokens=0,
                        device_pages=_ids(1, 2))
    bounds.match(sane, prompt_tokens=2 * PS)
    with pytest.raises(FailedPrecondition, match=r"host_tokens=-4 is not a whole number"):
        bounds.match(sane._replace(host_tokens=-PS), prompt_tokens=2 * PS)


def test_a_match_with_more_device_pages_than_its_device_tokens_is_refused() -> None:
    """Mutant: `got != want` -> `got < want` (reply_checks._device). device_tokens says
    one page, the reply hands two page ids: the engine would read KV from a page that
    holds nothing of this prompt."""
    bounds = _bounds()
    reply = MatchOutcome(device_tokens=PS, host_tokens=0, storage_tokens=0, device_pages=_ids(1, 2))
    with pytest.raises(FailedPrecondition, match=r"device_pages\[full\]: 2 pages for 4 tokens"):
        bounds.match(reply, prompt_tokens=2 * PS)


def test_a_load_message_after_the_final_one_is_refused() -> None:
    """Mutant: the `before.device_pages is not None` check dropped (reply_checks.load).
    The final message (with device pages) ends a Load stream; one more is junk."""
    bounds = _bounds()
    final = LoadProgress(layers_ready=2, layers_total=2, device_pages=_ids(3), device_tokens=PS)
    bounds.load(final, LoadProgress(1, 2))
    with pytest.raises(FailedPrecondition, match="a message after the last one"):
        bounds.load(LoadProgress(2, 2), final)


def test_a_load_stream_whose_layer_total_changes_is_refused() -> None:
    """Mutant: the `layers_total != before.layers_total` test dropped. A stream that says
    1 of 2 layers, then 2 of 3, has not counted up to a fixed total."""
    bounds = _bounds()
    with pytest.raises(FailedPrecondition, match=r"layers_ready 2 of 3 after 1 of 2"):
        bounds.load(LoadProgress(2, 3), LoadProgress(1, 2))


def test_a_load_whose_final_device_tokens_are_not_whole_pages_is_refused() -> None:
    """Mutant: `tokens % self.page_size` dropped from the Load check. 6 tokens with a
    page size of 4 (and one page id) is no reply a daemon sends."""
    bounds = _bounds()
    final = LoadProgress(layers_ready=2, layers_total=2, device_pages=_ids(3), device_tokens=PS + 2)
    with pytest.raises(FailedPrecondition, match="device_tokens=6 is not a whole number of pages"):
        bounds.load(final, None)


# ----------------------------------------------------------------- controller bookkeeping


def test_retired_keep_lock_pages_count_as_locked_in_stats(tmp_path: Path) -> None:
    """Mutant: `EngineRegistry.held_pages` skips `retired` pages. Engines a and b both
    allocate for one 3-page prompt; a inserts it; b's keep_lock insert finds the tree
    holding those tokens already, so b's 3 pages stay b's (retired) until it releases.
    Stats then shows 6 locked L1 FULL pages (b's lock on the 3-page path + its 3
    retired pages), and 0 once b releases."""
    with built_controllers(tmp_path, "mr30") as make:
        ctl = make(storage__backend="none", write__l1_to_l2="write_back")
        for engine in ("a", "b"):
            ctl.attach(engine, 0, 1)
        prompt = seq(3)
        ma = ctl.match("a", MatchRequest("", prompt, lock=True, allocate_tokens=3 * PS))
        mb = ctl.match("b", MatchRequest("", prompt, lock=True, allocate_tokens=3 * PS))
        ctl.insert("a", InsertRequest("", prompt, lock_id=ma.lock_id, allocation_id=ma.allocation_id))
        ctl.insert("b", InsertRequest("", prompt, lock_id=mb.lock_id, allocation_id=mb.allocation_id,
                                      keep_lock=True))

        def l1_full() -> tuple[int, int]:
            (pool,) = [p for p in ctl.stats().pools if (p.tier, p.member) == ("device", "full")]
            return pool.used_pages, pool.locked_pages

        assert l1_full() == (6, 6)
        ctl.release("b", mb.lock_id, mb.allocation_id)
        assert l1_full() == (3, 0)


def test_an_attach_with_tp_rank_equal_to_tp_size_is_refused(tmp_path: Path) -> None:
    """Mutant: `0 <= tp_rank < tp_size` -> `<= tp_size` (EngineRegistry.attach). With
    model.tp_size 1 the only rank is 0; rank 1 is no rank of this model."""
    with built_controllers(tmp_path, "mr30") as make:
        ctl = make(storage__backend="none")
        with pytest.raises(InvalidArgument, match="tp_rank 1 is outside tp_size 1"):
            ctl.attach("e1", 1, 1)
        assert ctl.attach("e1", 0, 1).page_size == PS


def test_the_controller_itself_bounds_tokens_and_refuses_an_empty_session_id(tmp_path: Path) -> None:
    """Mutants: `len(tokens) // 4 > limit` -> `> limit + 1` (HybridCacheController.
    _check_tokens) and the empty-session_id check of `close_session` dropped (then
    NotFound). An in-process caller gets the same refusals the daemon's wire check gives."""
    with built_controllers(tmp_path, "mr30") as make:
        ctl = make(storage__backend="none", server__max_tokens_per_request=8)
        ctl.attach("e1", 0, 1)
        assert ctl.match("e1", MatchRequest("", seq(2))).device_tokens == 0  # 8 tokens: allowed
        with pytest.raises(InvalidArgument, match=r"9 tokens exceed server.max_tokens_per_request \(8\)"):
            ctl.match("e1", MatchRequest("", seq(2) + np.uint32(7).tobytes()))
        with pytest.raises(InvalidArgument, match="session_id: must be a non-empty string"):
            ctl.close_session("")


def test_a_tenants_prefetches_never_push_out_another_tenants_finished_record(tmp_path: Path) -> None:
    """Mutant: the prefetcher's `_tenant_of` is one tenant for all (`tenant_of_config`
    not wired; the existing per-tenant test calls `_forget_finished` itself). With two
    bearer tokens, token#1's engine prefetches a prompt from L3 once; token#0's engine
    then prefetches it three times with `keep_finished` 2: token#1's PrefetchStatus is
    still DONE, token#0's oldest record is the one forgotten."""
    tokens = [{"token": "a" * 16, "namespaces": ["*"]}, {"token": "b" * 16, "namespaces": ["*"]}]
    with built_controllers(tmp_path, "mr30") as make:
        ctl = make(server__tokens=tokens, write__l1_to_l2="write_through",
                   write__l2_to_l3="write_through")
        ctl.prefetcher._keep = 2  # (as test_prefetch_promises does: no config key)
        Engine(ctl, "token#0/e")
        prompt = seq(3, 100)
        Engine(ctl, "token#1/e").request(prompt)
        flushed(ctl, prompt)
        evict_all(ctl, Tier.DEVICE, Tier.HOST)
        theirs = prefetch_back(ctl, prompt, engine_id="token#1/e").prefetch_id
        mine = []
        for _ in range(3):
            evict_all(ctl, Tier.DEVICE, Tier.HOST)  # (only in L3 again: a prefetch starts)
            mine.append(prefetch_back(ctl, prompt, engine_id="token#0/e").prefetch_id)
        assert ctl.prefetch_status(theirs, "token#1/e").state is PrefetchState.DONE
        with pytest.raises(NotFound):
            ctl.prefetch_status(mine[0], "token#0/e")
        assert [ctl.prefetch_status(m, "token#0/e").state for m in mine[1:]] == [PrefetchState.DONE] * 2


def test_the_l3_breaker_trips_on_consecutive_failures_only() -> None:
    """Mutant: `CircuitBreaker.success` keeps the failure count. With threshold 3, two
    failures, a success, then two more failures are never 3 in a row: the breaker stays
    closed (a flaky store that mostly answers must not lose its backups); a third
    consecutive failure opens it, and a probe is allowed exactly at the cooldown's end."""
    now = [0.0]
    breaker = CircuitBreaker(threshold=3, cooldown_s=1.0, clock=lambda: now[0])
    breaker.failure()
    breaker.failure()
    breaker.success()
    breaker.failure()
    breaker.failure()
    assert (breaker.is_open, breaker.trips) == (False, 0)
    breaker.failure()
    assert (breaker.is_open, breaker.trips) == (True, 1)
    now[0] = 0.5
    assert not breaker.allow()
    now[0] = 1.0
    assert breaker.allow()  # (mutant `>` for `>=`: refused at exactly cooldown_s)


# ----------------------------------------------------------------- metrics


def test_aliased_core_counters_are_exported_once_under_their_canonical_name() -> None:
    """Mutant: `canonical_counters` forgets which keys it folded into canonical ones
    (`used.update(aliases)` dropped): every aliased counter is exported a second time as
    an extra (`hicache_lookups` twice, `hicache_backups_l2`, `hicache_leases_expired`)."""
    snap = StatsSnapshot(pools=(), counters={"lookups": 3, "backups_l2": 5, "leases_expired": 1,
                                             "backups_l3_failed": 9})
    names = [f.name for f in counter_families(snap)]
    assert len(names) == len(set(names)), names
    assert not {"hicache_backups_l2", "hicache_leases_expired"} & set(names)
    singles = {f.name: f.samples[0].value for f in counter_families(snap)
               if f.name in ("hicache_lookups", "hicache_expired_leases", "hicache_backups_l3_failed")}
    assert singles == {"hicache_lookups": 3, "hicache_expired_leases": 1, "hicache_backups_l3_failed": 9}


# ----------------------------------------------------------------- status messages


def test_a_status_message_of_exactly_the_limit_is_kept_whole() -> None:
    """Mutant: `len(data) <= MAX_STATUS_MESSAGE` -> `<`. A message of exactly 1024 bytes
    fits; one byte more is cut and says how much was left off."""
    whole = "x" * MAX_STATUS_MESSAGE
    assert status_of(InvalidArgument(whole))[1] == whole
    cut = status_of(InvalidArgument(whole + "y"))[1]
    assert cut == whole + "... (1 more characters)"


# ----------------------------------------------------------------- configuration bounds


def test_storage_file_threads_accepts_its_documented_maximum() -> None:
    """Mutant: `1 <= threads <= MAX_FILE_THREADS` -> `< MAX_FILE_THREADS`. 64 is allowed
    ("must be in [1, 64]"), 65 is not."""
    assert load_config(overrides=["storage.file.threads=64"]).storage.file.threads == 64
    with pytest.raises(ConfigError, match=r"storage.file.threads: 65 must be in \[1, 64\]"):
        load_config(overrides=["storage.file.threads=65"])


def test_a_blank_kv_dtype_is_refused() -> None:
    """Mutant: `not self.kv_dtype.strip()` -> `not self.kv_dtype`. kv_dtype seeds every
    L3 key: a blank one (spaces) is as much a mistake as an empty one."""
    with pytest.raises(ConfigError, match=r"model\.kv_dtype: must be a non-empty string"):
        load_config(overrides=["model.kv_dtype='  '"])


# ----------------------------------------------------------------- Admin Flush


class _FlushCore:
    """A core whose Flush wrote `written` pages and left `left` that L3 lacks."""

    def __init__(self, written: int, left: int) -> None:
        self.written, self.left = written, left

    def flush(self, _timeout_s: float) -> int:
        return self.written

    def unflushed_pages(self) -> int:
        return self.left


@pytest.mark.parametrize(("elapsed_s", "fails"), [(2.0, True), (0.5, False)])
def test_a_flush_that_wrote_some_pages_but_ran_out_of_time_is_an_error(
    monkeypatch: pytest.MonkeyPatch, elapsed_s: float, fails: bool,
) -> None:
    """Mutant: Flush's `time.monotonic() - started >= timeout_s` test dropped (only a
    flush that wrote nothing failed). A 1 s Flush that wrote 5 pages and still left 3
    when its time was up did not write everything: FAILED_PRECONDITION saying so. One
    that ended before its time with 3 pages left (inserted meanwhile) answers OK."""
    clock = iter([100.0, 100.0 + elapsed_s])  # (the flush's start, then its end)
    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    admin = service.AdminServicer(_FlushCore(written=5, left=3), default_flush_s=30.0)  # type: ignore[arg-type]
    request = apb.FlushRequest(timeout_ms=1000)
    if fails:
        with pytest.raises(FailedPrecondition, match=r"flushed 5 pages; 3 pages L3 lacks .* slower than 1 s"):
            admin.Flush(request, None)  # type: ignore[arg-type]
    else:
        assert admin.Flush(request, None).pages_written == 5  # type: ignore[arg-type]


# ----------------------------------------------------------------- L3 (redis)


def test_a_deep_check_canary_expires_even_without_storage_redis_ttl(redis_server: RedisServer) -> None:
    """Mutant: the canary's own TTL (`CANARY_TTL_S`, 60 s) dropped in RedisBackend's put.
    With `storage.redis.ttl_s` unset, objects never expire; a canary a daemon killed
    mid-check never removes must still go by itself."""
    cfg = storage_config(StorageBackendName.REDIS, redis_url=redis_server.url)
    assert cfg.redis.ttl_s is None
    backend = build_backend(cfg)
    raw = redis.Redis.from_url(redis_server.url)
    canary, page = f"{CANARY_PREFIX}mutation-review-s30", "mr30/page/full/tp0of1"
    try:
        assert backend.put_from([canary], Pool(1, seed=3).slots()) == [PutStatus.STORED]
        assert backend.put_from([page], Pool(1, seed=4).slots()) == [PutStatus.STORED]
        assert 0 < raw.ttl(canary) <= 60
        assert raw.ttl(page) == -1  # (no TTL configured: objects stay)
    finally:
        raw.delete(canary, page)
        raw.close()
        backend.close()

