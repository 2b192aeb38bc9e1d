"""L1 pools in shared memory: layout, descriptors, a second process mapping them, stale
segments of a killed daemon, and (on a GPU machine) CUDA IPC."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tierkit import eventually, oracle, tiny_config

from hicache.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hicache.tiers.base import PoolDescriptor, PoolKind
from hicache.tiers.device import (
    SHM_DIR,
    InstanceLock,
    ShmDevicePools,
    attach_device_pools,
    cleanup_stale_segments,
)
from hicache.types import ComponentKind

Make = Callable[..., ShmDevicePools]
TESTS = Path(__file__).parent


def test_pools_are_layer_major_segments_named_per_instance(make_device: Make, instance: str) -> None:
    pools = make_device(tiny_config())
    pid = os.getpid()
    assert [p.name for p in pools.segment_paths()] == [
        f"hicache-{instance}-{pid}-full",
        f"hicache-{instance}-{pid}-idx",
        f"hicache-{instance}-{pid}-mamba",
    ]
    full, idx, mamba = pools.descriptors()
    # full: 16 pages x 32 B per layer, 2 layers.
    assert full == PoolDescriptor(
        member="full", kind=PoolKind.SHM, handle=f"hicache-{instance}-{pid}-full".encode(),
        device=-1, num_pages=16, layer_stride_bytes=512, page_stride_bytes=32, layers=2,
        size_bytes=1024,
    )
    # The sidecar follows full's page ids (16 pages), with its own 3 layers of 8 B.
    assert (idx.num_pages, idx.layers, idx.page_stride_bytes) == (16, 3, 8)
    assert (mamba.num_pages, mamba.layers, mamba.page_stride_bytes) == (4, 2, 24)
    assert pools.layer("idx", 2).shape == (16, 8)
    assert pools.num_pages(ComponentKind.MAMBA) == 4
    assert pools.allocator(ComponentKind.FULL) is pools.allocator(ComponentKind.FULL)

    # Layer 1 of page 3 lives at 1 * layer_stride + 3 * page_stride of the segment.
    pools.layer("full", 1)[3] = 7
    raw = np.fromfile(pools.segment_paths()[0], dtype=np.uint8)
    assert (raw[512 + 96 : 512 + 128] == 7).all() and raw[:512].sum() == 0

    with pytest.raises(InvalidArgument, match=r"layer 2 out of range \[0, 2\)"):
        pools.layer("full", 2)
    with pytest.raises(InvalidArgument, match="unknown member 'kv'"):
        pools.layer("kv", 0)


def test_close_unlinks_every_segment(make_device: Make) -> None:
    pools = make_device(tiny_config())
    paths = pools.segment_paths()
    assert all(p.exists() for p in paths)
    pools.close()
    assert not any(p.exists() for p in paths)
    pools.close()  # idempotent
    with pytest.raises(FailedPrecondition, match="closed"):
        pools.layer("full", 0)
    with pytest.raises(FailedPrecondition, match="closed"):
        pools.descriptors()


def test_segments_get_their_memory_at_creation(make_device: Make) -> None:
    pools = make_device(tiny_config())
    for path in pools.segment_paths():
        st = path.stat()
        assert st.st_blocks * 512 >= st.st_size > 0  # not sparse: no SIGBUS on a full tmpfs later


def test_a_full_shm_filesystem_refuses_start_and_leaves_nothing(
    instance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = os.posix_fallocate, []

    def full(fd: int, offset: int, size: int) -> None:  # room for the first segment only
        calls.append(size)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ResourceExhausted, match=r"l1: /dev/shm has \d+ bytes free, the pool \S+ needs \d+"):
        ShmDevicePools.create(tiny_config(), instance)
    assert len(calls) == 2 and not list(Path("/dev/shm").glob(f"*{instance}*"))


ENGINE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tierkit import oracle
    from hicache.tiers.base import PoolDescriptor, PoolKind
    from hicache.tiers.device import attach_device_pools
    blobs = ("handle", "ref_counter_handle", "event_handle")
    descs = [PoolDescriptor(**{**d, "kind": PoolKind(d["kind"]), **{k: bytes.fromhex(d[k]) for k in blobs}})
             for d in json.loads(sys.argv[1])]
    views = attach_device_pools(descs)
    # Read what the daemon wrote: full pages 0..3, every layer.
    ok = all(np.array_equal(views["full"][l][p].numpy(), oracle("full", p, l, 32))
             for p in range(4) for l in range(2))
    # Write pages 8..9 of the sidecar for the daemon to see.
    for p in (8, 9):
        for l in range(3):
            views["idx"][l][p] = __import__("torch").from_numpy(oracle("idx", p, l, 8, salt=1))
    print(json.dumps({"read_ok": ok}))
    """
)


def _encode(descs: tuple[PoolDescriptor, ...]) -> str:
    return json.dumps(
        [{**dataclasses.asdict(d), "kind": d.kind.value, "handle": d.handle.hex(),
          "ref_counter_handle": d.ref_counter_handle.hex(), "event_handle": d.event_handle.hex()}
         for d in descs]
    )


def test_a_second_process_reads_and_writes_what_the_daemon_sees(make_device: Make) -> None:
    pools = make_device(tiny_config())
    for p in range(4):
        for layer in range(2):
            pools.layer("full", layer)[p] = torch.from_numpy(oracle("full", p, layer, 32))
    out = subprocess.run(
        [sys.executable, "-c", ENGINE,
         _encode(pools.descriptors()), str(TESTS)],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"read_ok": True}
    for p in (8, 9):
        for layer in range(3):
            assert np.array_equal(pools.layer("idx", layer)[p].numpy(), oracle("idx", p, layer, 8, 1))
    assert pools.layer("idx", 0)[7].numpy().sum() == 0


def test_attach_refuses_missing_and_foreign_segments(make_device: Make) -> None:
    pools = make_device(tiny_config())
    full = pools.descriptors()[0]
    with pytest.raises(NotFound, match="does not exist"):
        attach_device_pools([dataclasses.replace(full, handle=b"hicache-nobody-1-full")])
    with pytest.raises(InvalidArgument, match="not a hicache shm segment"):
        attach_device_pools([dataclasses.replace(full, handle=b"../etc/passwd")])
    with pytest.raises(InvalidArgument, match="holds 1024 bytes, the descriptor needs 2048"):
        attach_device_pools([dataclasses.replace(full, layers=4)])


DAEMON = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from tierkit import tiny_config
    from hicache.tiers.device import ShmDevicePools
    pools = ShmDevicePools.create(tiny_config(), sys.argv[1])
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_segments_of_a_killed_daemon_are_cleaned_at_start(instance: str, make_device: Make) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", DAEMON, instance, str(TESTS)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        stale = sorted(p.name for p in SHM_DIR.glob(f"hicache-{instance}-{proc.pid}-*"))
        assert len(stale) == 3
        # While the owner lives, a second daemon for the instance is refused.
        with pytest.raises(FailedPrecondition, match="already served by a live daemon"):
            ShmDevicePools.create(tiny_config(), instance)
        # Without the instance lock, a live owner PID is the only sign (and refuses too).
        with pytest.raises(FailedPrecondition, match=f"already served by live pid {proc.pid}"):
            cleanup_stale_segments(instance)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    # SIGKILL left them behind; a start in another test's worker may have swept them since
    # (`sweep_dead_instances`): there, or gone, and nothing else of the dead pid.
    assert {p.name for p in SHM_DIR.glob(f"hicache-{instance}-{proc.pid}-*")} <= set(stale)

    pools = make_device(tiny_config())  # cleans first
    assert not any((SHM_DIR / name).exists() for name in stale)
    assert all(p.exists() for p in pools.segment_paths())
    assert cleanup_stale_segments("nobody_here") == []


def test_segments_left_under_our_own_pid_are_stale_once_the_instance_is_locked(
    instance: str, make_device: Make
) -> None:
    """In a container the daemon is PID 1 every time: after a SIGKILL (OOM, end of the
    grace period) the restarted daemon finds segments 'owned' by its own, live, PID. The
    instance lock says they are a dead daemon's; the restart must not crash-loop."""
    leftover = SHM_DIR / f"hicache-{instance}-{os.getpid()}-full"
    leftover.write_bytes(b"\0" * 4096)
    try:
        pools = make_device(tiny_config())
        assert not leftover.exists() or leftover in pools.segment_paths()
        for path in pools.segment_paths():  # the group may open them read-write
            assert path.stat().st_mode & 0o777 == 0o660
        with pytest.raises(FailedPrecondition, match="already served by a live daemon"):
            ShmDevicePools.create(tiny_config(), instance)
    finally:
        if leftover.exists() and leftover not in pools.segment_paths():
            leftover.unlink()


def test_a_lock_file_unlinked_by_its_releasing_holder_is_never_held(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """B opens the lock file, A releases (unlinks it, drops the lock), B locks: B held a
    file no one else would find, so C created a new one and locked it too (two daemons
    for one instance, each unlinking the other's segments). B now takes the path's file."""
    import fcntl

    from hicache.tiers import device

    a = InstanceLock("inst", tmp_path)
    real = fcntl.flock

    def a_releases_first(fd: int, op: int) -> None:
        monkeypatch.setattr(device.fcntl, "flock", real)
        a.release()
        real(fd, op)

    monkeypatch.setattr(device.fcntl, "flock", a_releases_first)
    b = InstanceLock("inst", tmp_path)
    assert b.path.exists() and os.fstat(b._fd).st_nlink == 1  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition, match="already served by a live daemon"):
        InstanceLock("inst", tmp_path)
    b.release()


def test_a_start_waits_out_another_starts_sweep_holding_its_lock(tmp_path: Path) -> None:
    """A daemon starting while another's sweep holds its instance lock for a moment is
    not refused as "already served" (it tries the lock again for `wait_s`); a lock held
    for good still refuses it."""
    import threading

    sweeping = InstanceLock("inst", tmp_path)
    threading.Timer(0.2, sweeping.release).start()
    InstanceLock("inst", tmp_path, wait_s=5.0).release()
    held = InstanceLock("inst", tmp_path)
    with pytest.raises(FailedPrecondition, match="already served"):
        InstanceLock("inst", tmp_path, wait_s=0.2)
    held.release()


def test_a_start_sweeps_the_segments_of_dead_daemons_under_other_instance_names(
    instance: str, make_device: Make
) -> None:
    """A daemon killed and restarted under another instance name (another socket path or
    port) left its segments in /dev/shm until reboot; a start now removes every instance
    nobody holds the lock of, and leaves a live one alone."""
    dead, live = f"{instance}_dead", f"{instance}_live"
    (SHM_DIR / f"hicache-{dead}.lock").write_bytes(b"")  # a SIGKILL leaves it
    dead_segments = [SHM_DIR / f"hicache-{dead}-12345-{m}" for m in ("full", "mamba")]
    for path in dead_segments:
        path.write_bytes(b"\0" * 4096)
    held = InstanceLock(live)
    live_segment = SHM_DIR / f"hicache-{live}-{os.getpid()}-full"
    live_segment.write_bytes(b"\0" * 4096)
    try:
        make_device(tiny_config())
        # (a sweep in another test's worker holding the dead instance's lock for a moment
        # makes this one skip it; that sweep then removes them)
        assert eventually(lambda: not any(p.exists() for p in dead_segments)
                          and not (SHM_DIR / f"hicache-{dead}.lock").exists(), 10)
        assert live_segment.exists() and held.path.exists()
    finally:
        live_segment.unlink(missing_ok=True)
        held.release()
        for path in dead_segments:
            path.unlink(missing_ok=True)


def test_another_users_instance_is_a_clear_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock file or a dead daemon's segment this user may not touch (another user's
    daemon used the name) used to surface as a raw PermissionError traceback."""
    from hicache.tiers import device

    real_open = os.open

    def denied(path, flags, mode=0o777):  # type: ignore[no-untyped-def]
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(device.os, "open", denied)
    with pytest.raises(FailedPrecondition, match="another user's daemon uses this instance name"):
        InstanceLock("inst", tmp_path)
    monkeypatch.undo()
    segment = tmp_path / "hicache-inst-12345-full"
    segment.write_bytes(b"")
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:  # the segment is not ours
        if self == segment:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    lock = InstanceLock("inst", tmp_path)
    with pytest.raises(FailedPrecondition, match="cannot remove the dead daemon's segment"):
        cleanup_stale_segments("inst", tmp_path, lock)
    lock.release()
    (tmp_path / "hicache-inst.lock").write_bytes(b"")  # as a killed daemon leaves it
    assert device.sweep_dead_instances(tmp_path) == []  # skipped (logged): never fails a start
    assert segment.exists()


def test_a_sweep_never_touches_a_lock_file_without_segments(tmp_path: Path) -> None:
    """A unix socket in /dev/shm named hicache-<x>.sock has its own lock file,
    hicache-<x>.sock.lock, alike an instance's: a sweep used to lock and unlink it, and
    its daemon (between opening and locking it) then held a file no one else would find."""
    from hicache.endpoint import SocketLock
    from hicache.tiers import device

    socket_lock = tmp_path / "hicache-engine0.sock.lock"
    socket_lock.write_text("")  # left by a daemon that stopped cleanly
    inode = socket_lock.stat().st_ino
    assert device.sweep_dead_instances(tmp_path, keep="other") == []
    assert socket_lock.exists() and socket_lock.stat().st_ino == inode
    first = SocketLock(tmp_path / "hicache-engine0.sock")
    first.acquire()
    with pytest.raises(FailedPrecondition):
        SocketLock(tmp_path / "hicache-engine0.sock").acquire()
    first.release()


def test_instance_names_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="letters, digits"):
        cleanup_stale_segments("a-b")
    with pytest.raises(InvalidArgument, match="letters, digits"):
        ShmDevicePools.create(tiny_config(), "../x")


CUDA_ENGINE = textwrap.dedent(
    """
    import pickle, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from tierkit import oracle
    from hicache.tiers.device import attach_device_pools
    descs = pickle.loads(sys.stdin.buffer.read())
    views = attach_device_pools(descs)
    ok = all(torch.equal(views["full"][l][p].cpu(), torch.from_numpy(oracle("full", p, l, 32)))
             for p in range(4) for l in range(2))
    views["full"][0][5] = torch.from_numpy(oracle("full", 5, 0, 32, salt=2)).cuda()
    torch.cuda.synchronize()
    print("read_ok" if ok else "read_bad", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pools_round_trip_through_ipc_in_another_process() -> None:
    import pickle

    from hicache.tiers.cuda import CudaDevicePools

    pools = CudaDevicePools.create(tiny_config())
    try:
        for p in range(4):
            for layer in range(2):
                pools.layer("full", layer)[p] = torch.from_numpy(oracle("full", p, layer, 32)).cuda()
        torch.cuda.synchronize()
        descs = pools.descriptors()
        assert descs[0].kind is PoolKind.CUDA_IPC and len(descs[0].handle) > 0
        out = subprocess.run(
            [sys.executable, "-c", CUDA_ENGINE, str(TESTS)], input=pickle.dumps(descs),
            capture_output=True, timeout=120, check=True,
        )
        assert out.stdout.decode().strip().endswith("read_ok")
        expected = torch.from_numpy(oracle("full", 5, 0, 32, salt=2))
        assert torch.equal(pools.layer("full", 0)[5].cpu(), expected)
    finally:
        pools.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_l1_device_cuda_refuses_to_start_without_cuda_and_shm_or_auto_serve_from_shm(
    tmp_path: Path,
) -> None:
    from hicache.tiers.device import build_device_pools
    from hicache.types import L1Device

    cfg = tiny_config()
    for device in (L1Device.AUTO, L1Device.SHM):
        chosen = dataclasses.replace(
            cfg, tiers=dataclasses.replace(cfg.tiers, l1=dataclasses.replace(cfg.tiers.l1, device=device)))
        pools = build_device_pools(chosen, f"dev_{device.value}", shm_dir=tmp_path)
        try:
            assert isinstance(pools, ShmDevicePools) and not pools.is_cuda
        finally:
            pools.close()
    cuda = dataclasses.replace(
        cfg, tiers=dataclasses.replace(cfg.tiers, l1=dataclasses.replace(cfg.tiers.l1, device=L1Device.CUDA)))
    with pytest.raises(FailedPrecondition, match=r"tiers.l1.device=cuda: CUDA is not available"):
        build_device_pools(cuda, "dev_cuda", shm_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if "dev_cuda" in p.name]
