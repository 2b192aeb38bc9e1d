"""Review of the day's diff (c0bca76..HEAD, session 24): eviction queues' `lparked`, the
modes of made folders and files (hicache/dirs.py, the socket lock, the file L3), the lease
sweep's stall detection, client timeouts, and the CPU tiers without torch.

The bugs it found are fixed (leases capped at a full lease from now after a stall, modes
set whatever the umask, ASCII host tags, the secrets warning naming only a file holding
tokens); the rest pins behaviour found correct."""

from __future__ import annotations

import json
import math
import os
import random
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest

import hicache.tiers.storage.file as file_mod
from hicache import cli
from hicache.config import FileStorageConfig, load_config
from hicache.controller.engines import EngineRegistry
from hicache.dirs import GROUP_DIR_MODE, GROUP_FILE_MODE, make_dirs
from hicache.endpoint import SocketLock
from hicache.errors import BackendUnavailable, FailedPrecondition, HicacheError
from hicache.tiers.storage.file import FileBackend
from hicache.tree import HiRadixTree
from hicache.types import ComponentKind, Tier

FULL, SWA, MAMBA = ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA
REPO = Path(__file__).resolve().parents[1]


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------- leases: stall detection


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sweep(reg: EngineRegistry, last: float, now: float, period: float) -> tuple[float, list[str]]:
    """What `Daemon._sweep_leases` does, on the registry (the controller's part)."""
    stalled = now - last - 2 * period
    if stalled > 0:
        reg.extend_leases(stalled)
    return now, [e.engine_id for e in reg.lapsed()]


def test_dead_engine_lapses_even_when_every_sweep_is_late() -> None:
    """Repeated stalls do not keep a dead engine's lease forever: each late sweep extends
    it by its lateness past two periods, so real time still gains two periods a sweep."""
    clock = FakeClock()
    lease = 3.0
    period = lease / 3
    reg = EngineRegistry(lease, clock)
    reg.attach("dead", 0, 1)
    reg.renew("dead")  # its last heartbeat
    last = clock.t
    gone: list[str] = []
    for _ in range(10):
        clock.t += 7.5 * period  # every sweep runs 7.5 periods apart (a daemon that keeps stalling)
        last, gone = _sweep(reg, last, clock.t, period)
        if gone:
            break
    assert gone == ["dead"]


def test_lease_renewed_after_a_stall_is_not_extended_by_it() -> None:
    """The daemon measures a stall at the sweep after it (one that was itself slow, or a
    sweep that runs after the resumed engines' heartbeats): `extend_leases` then adds the
    stall to leases that were renewed after it, which no stall ever shortened. An engine
    that dies right after its post-stall heartbeat keeps its locks and allocations for
    lease + stall (an hour-long VM pause: an hour), not for its lease."""
    clock = FakeClock()
    lease = 3.0
    reg = EngineRegistry(lease, clock)
    reg.attach("e", 0, 1)
    reg.renew("e")
    clock.t += 600.0  # the daemon did not run for 10 minutes
    reg.renew("e")  # the engine's heartbeat, served as soon as the daemon runs again
    reg.extend_leases(600.0 - 2 * lease / 3)  # the sweep that notices the stall
    # The engine dies now. Its lease, renewed after the stall, ends `lease` later.
    clock.t += lease + 1.0
    assert [e.engine_id for e in reg.lapsed()] == ["e"]


# ---------------------------------------------------------------- client timeouts


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, 0.0, 2e8, "5", None])
def test_client_refuses_unusable_timeouts(bad: object) -> None:
    from hicache.client import Client

    with pytest.raises(HicacheError):
        Client("unix:///tmp/hicache-s24-none.sock", timeout_s=bad)  # type: ignore[arg-type]


def test_client_wait_ready_inf_and_bad_waits(tmp_path: Path) -> None:
    from hicache.client import Client
    from hicache.errors import InvalidArgument, Unavailable

    client = Client(f"unix://{tmp_path}/none.sock", timeout_s=2.0)
    try:
        for bad in (math.nan, -1.0):
            with pytest.raises(InvalidArgument):
                client.wait_ready(bad)
        started = time.monotonic()
        with pytest.raises(Unavailable):
            client.wait_ready(0.2)
        assert time.monotonic() - started < 5
    finally:
        client.close()


# ---------------------------------------------------------------- folders, socket lock


def test_make_dirs_modes_under_umask_000(tmp_path: Path) -> None:
    with umask(0):
        make_dirs(tmp_path / "a" / "b" / "c", GROUP_DIR_MODE)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b" / "c").st_mode) == 0o770


def test_socket_lock_refuses_a_link_and_a_hard_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    sock = tmp_path / "run" / "h.sock"
    make_dirs(sock.parent)
    os.symlink(victim, str(sock) + ".lock")
    with pytest.raises(FailedPrecondition):
        SocketLock(sock).acquire()
    os.unlink(str(sock) + ".lock")
    os.link(victim, str(sock) + ".lock")
    with pytest.raises(FailedPrecondition):
        SocketLock(sock).acquire()
    assert victim.read_text() == "keep me"


# ---------------------------------------------------------------- the file L3


def _backend(root: Path) -> FileBackend:
    return FileBackend(FileStorageConfig(path=str(root)), 2.0)


def _put(backend: FileBackend, key: str, nbytes: int = 256) -> None:
    buf = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    statuses = backend.put_from([key], [buf])
    assert [s.name for s in statuses] == ["STORED"], statuses


def test_world_writable_root_refused_unless_sticky(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o777)
    b = _backend(root)
    with pytest.raises(BackendUnavailable):
        b.start()
    b.close()
    os.chmod(root, 0o1777)
    b = _backend(root)
    try:
        b.start()
        assert b.wait_indexed(10)
        _put(b, "s24/sticky")
    finally:
        b.close(2.0)


def test_root_given_as_a_link_to_a_folder_works_and_its_temps_are_cleaned(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o750)
    link = tmp_path / "link"
    os.symlink(real, link)
    b = _backend(link)
    try:
        b.start()
        assert b.wait_indexed(10)
        _put(b, "s24/link")
        obj = Path(b.path_of("s24/link"))
        # A dead writer's temp file beside it, as this code names it, and a stranger's.
        ours = Path(f"{obj}.{b._host}.{2**22 + 12345}.140000000000.tmp")
        foreign = obj.parent / "notes.tmp"
        for p in (ours, foreign):
            p.write_bytes(b"x")
            os.utime(p, (time.time() - 3600, time.time() - 3600))
    finally:
        b.close(2.0)
    b = _backend(link)
    try:
        b.start()
        assert b.wait_indexed(10)
        assert not ours.exists()
        assert foreign.exists()
    finally:
        b.close(2.0)


def test_probe_makes_a_removed_root_again_with_group_mode(tmp_path: Path) -> None:
    root = tmp_path / "gone"
    b = _backend(root)
    try:
        with umask(0):
            b.start()
            assert b.wait_indexed(10)
            os.rmdir(root)
            b.health(deep=False)
        assert stat.S_IMODE(os.stat(root).st_mode) == GROUP_DIR_MODE
    finally:
        b.close(2.0)


def test_store_modes_hold_under_the_default_umask(tmp_path: Path) -> None:
    """README (storage.file.path): "Its folders are made 0770 and its objects 0660
    whatever the umask"; dirs.py: GROUP_DIR_MODE is "what the daemon and its group's
    daemons write". `make_dirs` and `_write_file` pass the mode to mkdir/open only, which
    the umask masks: under 022 (a shell's, systemd's default) another daemon of the group
    sharing the store cannot create an object in a fan-out folder the first one made."""
    root = tmp_path / "store"
    b = _backend(root)
    try:
        with umask(0o022):
            b.start()
            assert b.wait_indexed(10)
            _put(b, "s24/umask")
        obj = Path(b.path_of("s24/umask"))
        assert stat.S_IMODE(os.stat(obj.parent).st_mode) == GROUP_DIR_MODE
        assert stat.S_IMODE(os.stat(obj).st_mode) == GROUP_FILE_MODE
    finally:
        b.close(2.0)


def test_temp_files_of_a_non_ascii_host_are_cleaned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_host_tag` keeps `str.isalnum()` characters (any script's letters and digits);
    `_temp_of_ours` now accepts only `[A-Za-z0-9_-]`: the start no longer removes the
    temp files this same daemon writes (dead writers' or stale ones), they stay for good."""
    monkeypatch.setattr(file_mod.socket, "gethostname", lambda: "knoten-\u00fc1")
    root = tmp_path / "store"
    b = _backend(root)
    try:
        b.start()
        assert b.wait_indexed(10)
        _put(b, "s24/host")
        obj = Path(b.path_of("s24/host"))
        stale = Path(f"{obj}.{b._host}.{2**22 + 777}.140000000001.tmp")
        stale.write_bytes(b"torn")
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
    finally:
        b.close(2.0)
    b = _backend(root)
    try:
        b.start()
        assert b.wait_indexed(10)
        assert not stale.exists()
    finally:
        b.close(2.0)


# ---------------------------------------------------------------- eviction queues: lparked


def _tree() -> HiRadixTree:
    return HiRadixTree(2, {FULL: 0, SWA: 3, MAMBA: 0})


def _page_ids() -> Callable[[int], np.ndarray]:
    """`fresh(n)`: `n` page ids never handed out before."""
    counter = [1000]

    def fresh(n: int) -> np.ndarray:
        out = np.arange(counter[0], counter[0] + n, dtype=np.int64)
        counter[0] += n
        return out

    return fresh


def _prompt(rng: random.Random, bases: list[int]) -> tuple[int, bytes]:
    """A prompt of 2-23 tokens sharing a prefix of up to 29 with others of its base."""
    base = rng.choice(bases)
    n = rng.randrange(2, 24)
    cut = rng.randrange(4, 30)
    return n, np.array([base * 1000 + i if i < cut else 7 * base + 3 * i for i in range(n)],
                       dtype="<u4").tobytes()


def _fuzz_tree(seed: int, ops: int) -> dict[ComponentKind, int]:
    rng = random.Random(seed)
    tree = _tree()
    fresh = _page_ids()

    locks = []
    bases = [rng.randrange(0, 50) for _ in range(4)]
    for _ in range(ops):
        op = rng.random()
        n, toks = _prompt(rng, bases)
        if op < 0.35:
            pages = n // 2
            tree.insert("ns", toks, {FULL: fresh(pages), SWA: fresh(pages)},
                        mamba_slot=int(fresh(1)[0]), session_id=rng.choice([None, "s1", "s2"]))
        elif op < 0.6:
            r = tree.match("ns", toks, lock=True, session_id=rng.choice([None, "s1"]))
            if r.lock is not None:
                locks.append(r.lock)
        elif op < 0.75 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.95:
            tree.evict(Tier.DEVICE, rng.choice([FULL, SWA, MAMBA]), rng.randrange(1, 6))
        else:
            with suppress(HicacheError):
                tree.close_session(rng.choice(["s1", "s2"]))
        tree.check_integrity()
    for lock in locks:
        tree.unlock(lock)
    tree.check_integrity()
    for kind in (MAMBA, SWA, FULL, MAMBA, SWA, FULL):
        tree.evict(Tier.DEVICE, kind, 10**6)
    tree.check_integrity()
    return {k: tree.resident_pages(Tier.DEVICE, k) for k in (FULL, SWA, MAMBA)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_locks_evictions_sessions_leave_nothing_unevictable(seed: int) -> None:
    """Hybrid tree (FULL, SWA window 3, MAMBA points): locks popped while held (lparked),
    splits under held locks, sessions, then every lock released: the integrity check
    holds after every op, and everything can be evicted at the end (no candidate lost)."""
    assert _fuzz_tree(seed, 250) == {FULL: 0, SWA: 0, MAMBA: 0}


def _fuzz_write_back(seed: int, ops: int) -> dict[tuple[str, str], int]:
    """Write-back L1 (`backed_up_tiers`): evictions whose `before_drop` copies to L2, parks
    (its copy comes later) or makes no copy, with locks held and released meanwhile."""
    rng = random.Random(seed)
    tree = HiRadixTree(2, {FULL: 0, SWA: 3, MAMBA: 0}, backed_up_tiers=(Tier.DEVICE,))
    fresh = _page_ids()

    def backup(mode: str | None):
        def before_drop(victim) -> bool:
            how = mode or rng.choice(["copy", "copy", "park", "none"])
            if how == "copy":
                for kind in sorted(victim.pages, key=lambda k: k is not FULL):
                    if not tree.is_resident(victim.node, kind, Tier.HOST):
                        with suppress(HicacheError):
                            tree.set_resident(victim.node, kind, Tier.HOST, fresh(len(victim.pages[kind])))
                return False
            return how == "park"
        return before_drop

    locks = []
    bases = [rng.randrange(0, 50) for _ in range(4)]
    for _ in range(ops):
        op = rng.random()
        n, toks = _prompt(rng, bases)
        if op < 0.3:
            tree.insert("ns", toks, {FULL: fresh(n // 2), SWA: fresh(n // 2)},
                        mamba_slot=int(fresh(1)[0]), session_id=rng.choice([None, "s1", "s2"]))
        elif op < 0.5:
            r = tree.match("ns", toks, lock=True, session_id=rng.choice([None, "s1"]))
            if r.lock is not None:
                locks.append(r.lock)
        elif op < 0.65 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.85:
            tree.evict(Tier.DEVICE, rng.choice([FULL, SWA, MAMBA]), rng.randrange(1, 6),
                       before_drop=backup(None))
        elif op < 0.95:
            tree.evict(Tier.HOST, rng.choice([FULL, SWA, MAMBA]), rng.randrange(1, 6))
        else:
            with suppress(HicacheError):
                tree.close_session(rng.choice(["s1", "s2"]))
        tree.check_integrity()
    for lock in locks:
        tree.unlock(lock)
    tree.check_integrity()
    for _ in range(2):
        for kind in (MAMBA, SWA, FULL):
            tree.evict(Tier.DEVICE, kind, 10**6, before_drop=backup("copy"))
    for _ in range(2):
        for kind in (MAMBA, SWA, FULL):
            tree.evict(Tier.HOST, kind, 10**6)
    tree.check_integrity()
    return {(t.name, k.value): tree.resident_pages(t, k)
            for t in (Tier.DEVICE, Tier.HOST) for k in (FULL, SWA, MAMBA) if tree.resident_pages(t, k)}


@pytest.mark.parametrize("seed", [3, 4])
def test_write_back_parks_and_lock_parks_leave_nothing_unevictable(seed: int) -> None:
    assert _fuzz_write_back(seed, 250) == {}


def test_locked_leaf_parked_then_split_is_offered_again_at_unlock() -> None:
    tree = _tree()
    a = np.arange(0, 16, dtype="<u4").tobytes()
    tree.insert("ns", a, {FULL: np.arange(8), SWA: np.arange(100, 108)}, mamba_slot=500)
    lock = tree.match("ns", a, lock=True).lock
    assert lock is not None
    r = tree.evict(Tier.DEVICE, FULL, 100)
    assert r.evicted_pages == 0
    leaf = lock.end
    assert leaf.lparked  # type: ignore[union-attr]
    # Another request diverges inside the locked leaf: it is split under the lock.
    b = np.concatenate([np.arange(0, 6), np.arange(900, 910)]).astype("<u4").tobytes()
    tree.insert("ns", b, {FULL: np.arange(20, 28), SWA: np.arange(120, 128)}, mamba_slot=501)
    tree.check_integrity()
    tree.unlock(lock)
    tree.check_integrity()
    tree.evict(Tier.DEVICE, FULL, 100)
    assert tree.resident_pages(Tier.DEVICE, FULL) == 0


# ---------------------------------------------------------------- the CPU tiers, torch


_NO_TORCH = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None  # any import of torch fails
    sys.path.insert(0, "tests/tiers")
    import numpy as np
    from tierkit import oracle, tiny_config
    from hicache.tiers.copy import CpuCopyEngine, copies_can_be_large
    from hicache.tiers.device import build_device_pools
    from hicache.tiers.host import build_host_pools
    from hicache.types import ComponentKind
    FULL = ComponentKind.FULL
    cfg = tiny_config()
    dev = build_device_pools(cfg, "s24nt%d" % __import__("os").getpid(), use_cuda=False)
    host = build_host_pools(cfg, pin=False)
    out = {"large": copies_can_be_large(dev, host)}
    try:
        engine = CpuCopyEngine(dev, host)
        d = dev.allocator(FULL).allocate(5)
        h = host.allocator(FULL).allocate(5)
        for spec in dev.family(FULL):
            for layer in range(spec.layers):
                rows = dev.layer_array(spec.name, layer)
                for p in d.tolist():
                    rows[p] = oracle(spec.name, p, layer, rows.shape[1])
        engine.device_to_host(FULL, d[::-1].copy(), h)
        ok = True
        for spec in host.family(FULL):
            for layer in range(spec.layers):
                rows = host.layer_array(spec.name, layer)
                for p, o in zip(h.tolist(), d[::-1].tolist()):
                    ok &= bool(np.array_equal(rows[p], oracle(spec.name, o, layer, rows.shape[1])))
        engine.close()
        out["ok"] = ok
    finally:
        dev.close()
        host.close()
    print(json.dumps(out))
""")


def test_cpu_small_pools_copy_without_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"large": False, "ok": True}


def test_daemon_modules_do_not_import_torch() -> None:
    code = ("import sys\nimport hicache.server, hicache.cli, hicache.service, controller.controller\n"
            "import hicache.tiers.copy, hicache.tiers.device, hicache.tiers.host, hicache.tiers.rows\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


# ---------------------------------------------------------------- serve's secrets warning


@pytest.mark.parametrize("in_file", [True, False], ids=["tokens-in-file", "tokens-by-set"])
def test_readable_config_is_warned_about_only_when_it_holds_the_tokens(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, in_file: bool) -> None:
    """The warning names the config file as holding server.tokens only when it does: with
    the tokens given by `--set`, a readable config holds no secret."""
    config = tmp_path / "hicache.yaml"
    tokens = "[{token: review-token-0123456789, namespaces: ['*']}]"
    config.write_text(f"server:\n  tokens: {tokens}\n" if in_file else "tiers:\n  l1:\n    tokens: 1024\n")
    os.chmod(config, 0o644)
    cfg = load_config(str(config), [] if in_file else [f"server.tokens={tokens}"])
    assert cfg.server.tokens
    with caplog.at_level("WARNING", logger="hicache"):
        cli._warn_readable_secrets(str(config), cfg)
    warned = [r.getMessage() for r in caplog.records if "server.tokens" in r.getMessage()]
    assert bool(warned) is in_file, warned
    assert all("review-token" not in m for m in warned)
