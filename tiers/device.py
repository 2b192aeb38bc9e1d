"""L1 device pools: POSIX shared memory on a CPU-only node, CUDA memory + IPC on a GPU.

Each member pool is ``layers`` contiguous regions of ``[num_pages, bytes_per_page_per_layer]``
(layer-major, as attention kernels expect). The daemon creates them (`build_device_pools`)
and hands `PoolDescriptor`s to engines, which map them with `attach_device_pools`.

Shared-memory segments are files under ``/dev/shm`` named
``hicache-<instance>-<owner pid>-<member>``: the owner pid in the name lets a restarted
daemon recognise (and unlink) the segments of one that was killed (`cleanup_stale_segments`).
A starting daemon also unlinks those of every other instance nobody holds the lock of
(`sweep_dead_instances`): one killed and restarted under another name (another socket
path or port) would otherwise leave its L1 memory there until the node reboots.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hicache.config import HicacheConfig, MemberSpec
from hicache.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from hicache.tiers.accelerator import cuda_available
from hicache.tiers.base import DevicePools, PoolDescriptor, PoolKind
from hicache.tiers.members import MemberTable
from hicache.tiers.prefault import Prefaulter
from hicache.types import ComponentKind, L1Device

if TYPE_CHECKING:  # torch is imported where a tensor is made: a CPU daemon may never need it
    import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "hicache-"
LOCK_WAIT_S = 1.0  # a start tries a held instance lock this long (see `InstanceLock`)
SEGMENT_MODE = 0o660  # like the control socket: the engine may run as another user of the group
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.]+")
_MEMBER_RE = re.compile(r"[A-Za-z0-9_.-]+")


def segment_name(instance: str, pid: int, member: str) -> str:
    """The shm segment name of one member pool; validates both parts."""
    if not _INSTANCE_RE.fullmatch(instance):
        raise InvalidArgument(
            f"daemon instance name {instance!r}: use letters, digits, '_' or '.' only"
        )
    if not _MEMBER_RE.fullmatch(member):
        raise InvalidArgument(f"member name {member!r} cannot be part of a shm segment name")
    return f"{SEGMENT_PREFIX}{instance}-{pid}-{member}"


class InstanceLock:
    """An exclusive flock on `<shm_dir>/hicache-<instance>.lock`, held while a daemon's
    pools live: two daemons cannot serve one instance, and the holder knows every other
    segment of the instance is a dead daemon's. Unlike owner PIDs it holds across PID
    namespaces sharing /dev/shm (containers, where every daemon is PID 1)."""

    def __init__(self, instance: str, shm_dir: Path = SHM_DIR, wait_s: float = 0.0) -> None:
        """`wait_s`: how long a held lock is tried again (another daemon's start sweeping
        dead instances holds each lock it finds for a moment)."""
        segment_name(instance, 0, "x")  # validates the instance name
        self.path = shm_dir / f"{SEGMENT_PREFIX}{instance}.lock"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except PermissionError as e:
                if not os.access(shm_dir, os.W_OK):
                    raise _unusable(shm_dir, self.path, e) from None
                raise FailedPrecondition(
                    f"daemon instance {instance!r}: cannot open {self.path} ({e.strerror}): "
                    "another user's daemon uses this instance name; pick another one"
                ) from None
            except OSError as e:  # read-only, no inode left, ...
                raise _unusable(shm_dir, self.path, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise FailedPrecondition(
                    f"daemon instance {instance!r} is already served by a live daemon (it "
                    f"holds {self.path}); stop it or pick another instance name"
                ) from None
            # A holder unlinks the file when it releases (a daemon leaves nothing in
            # /dev/shm; `SocketLock` keeps its file instead, beside the socket): the one
            # locked here may be that unlinked file (opened just before), which nobody else
            # will ever find. Held only when it is still the file at the path.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # (while still held: see __init__ for the race)
        os.close(self._fd)  # drops the lock
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def cleanup_stale_segments(instance: str, shm_dir: Path = SHM_DIR,
                           lock: InstanceLock | None = None) -> list[str]:
    """Unlink the segments of `instance` whose owner is gone; return their names.

    Holding the instance's `lock`, every segment of the instance is a dead daemon's (its
    PID may even be ours: a restarted container is PID 1 again). Without it, a segment is
    stale when its owner PID is not alive; `FailedPrecondition` when a live process (this
    one included) owns one: two daemons must not serve one instance.
    """
    prefix = f"{SEGMENT_PREFIX}{instance}-"
    segment_name(instance, 0, "x")  # validates the instance name
    removed: list[str] = []
    for path in sorted(shm_dir.glob(f"{prefix}*")):
        pid_text = path.name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if lock is None and _process_alive(pid):
            raise FailedPrecondition(
                f"daemon instance {instance!r} is already served by live pid {pid} "
                f"(segment {shm_dir / path.name}); stop it or pick another instance name"
            )
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except PermissionError as e:
            raise FailedPrecondition(
                f"daemon instance {instance!r}: cannot remove the dead daemon's segment {path} "
                f"({e.strerror}): remove it as its owner, or pick another instance name"
            ) from None
        removed.append(path.name)
    return removed


def sweep_dead_instances(shm_dir: Path = SHM_DIR, keep: str = "") -> list[str]:
    """Unlink the segments (and then the lock file) of every instance but `keep` that has
    segments and whose lock nobody holds: its daemon is dead. (A lock file without
    segments is left alone: it may be another file named alike.) Returns the segments' names. An instance a live
    daemon holds is left alone, and one whose files this user may not remove is skipped
    (logged): the sweep never fails a start."""
    removed: list[str] = []
    for lock_path in sorted(shm_dir.glob(f"{SEGMENT_PREFIX}*.lock")):
        instance = lock_path.name[len(SEGMENT_PREFIX) : -len(".lock")]
        if instance == keep or not _INSTANCE_RE.fullmatch(instance):
            continue
        # Only an instance with segments to sweep is locked: another file named alike (a
        # unix socket's own lock file, `hicache-<name>.sock.lock`, when the socket lives in
        # /dev/shm) is never touched.
        if not any(shm_dir.glob(f"{SEGMENT_PREFIX}{instance}-*")):
            continue
        try:
            lock = InstanceLock(instance, shm_dir)
        except FailedPrecondition:
            continue  # served by a live daemon
        except OSError as e:
            log.info("not sweeping daemon instance %r: %s", instance, e)
            continue
        try:
            removed += cleanup_stale_segments(instance, shm_dir, lock)
        except (OSError, FailedPrecondition) as e:  # (another user's segments)
            log.info("could not sweep daemon instance %r: %s", instance, e)
        finally:
            lock.release()
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child that its parent has not reaped yet is a zombie: it owns nothing.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _address(m: mmap.mmap) -> int:
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


def _unusable(shm_dir: Path, path: Path, e: OSError) -> FailedPrecondition:
    return FailedPrecondition(
        f"l1: cannot create {path} ({e.strerror}): {shm_dir} must be a writable tmpfs with "
        "room and free inodes"
    )


def _reserve(fd: int, path: Path, size: int) -> None:
    """Give the new segment its memory now. A tmpfs file is sparse: without this, a full
    /dev/shm surfaces later as SIGBUS in whichever process first writes a missing page
    (the daemon or an engine), and every first write pays the page allocation."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            free = os.statvfs(path.parent)
            raise ResourceExhausted(
                f"l1: {path.parent} has {free.f_bavail * free.f_frsize} bytes free, the pool "
                f"{path.name} needs {size} (enlarge that tmpfs or lower tiers.l1.tokens / "
                "tiers.l1.size_gb)"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


class _Segment:
    """One mapped shm file: created by the daemon or opened by an engine."""

    def __init__(self, path: Path, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, SEGMENT_MODE)
            if create:
                os.fchmod(fd, SEGMENT_MODE)  # the umask (0022 in containers) took group write
        except FileExistsError:
            raise FailedPrecondition(f"shm segment {path} already exists") from None
        except FileNotFoundError:
            raise NotFound(f"shm segment {path} does not exist (daemon gone?)") from None
        except OSError as e:
            if not create:
                raise
            raise _unusable(path.parent, path, e) from None
        try:
            if create:
                os.ftruncate(fd, size)
                _reserve(fd, path, size)
            elif os.fstat(fd).st_size < size:
                raise InvalidArgument(
                    f"shm segment {path} holds {os.fstat(fd).st_size} bytes, "
                    f"the descriptor needs {size}"
                )
            try:
                self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                if e.errno != errno.ENOMEM:
                    raise
                raise ConfigError(
                    f"tiers.l1: {path.name} ({size} bytes) cannot be mapped ({e.strerror}): the "
                    "address-space limit (ulimit -v) or the kernel's overcommit refuses it; "
                    "lower tiers.l1.tokens / tiers.l1.size_gb or raise the limit"
                ) from None
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Huge pages cut TLB misses of page gathers; tmpfs honours this only when
                # /sys/kernel/mm/transparent_hugepage/shmem_enabled is 'advise' or more.
                with contextlib.suppress(OSError):
                    self.map.madvise(mmap.MADV_HUGEPAGE)
            # The daemon maps its own segments' pages up front (an engine faults in its own
            # mapping of the same, already allocated, pages).
            self.prefault = Prefaulter(_address(self.map), size, path.name) if create else None
        except BaseException:
            if create:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.path = path

    def close(self, unlink: bool) -> None:
        if self.prefault is not None:
            self.prefault.stop()  # before the memory goes
            self.prefault = None
        if unlink:
            self.path.unlink(missing_ok=True)
        # NOTE: a view still alive somewhere keeps the mapping; it is then unmapped when
        # the last view goes (the name is gone already, so nothing leaks past the process).
        with contextlib.suppress(BufferError):
            self.map.close()


class ShmDevicePools(MemberTable, DevicePools):
    """L1 pools in POSIX shared memory, one segment per member.

    Build with `create` (or `build_device_pools`), which first cleans stale segments.
    """

    def __init__(
        self,
        instance: str,
        members: Sequence[MemberSpec],
        pages: Mapping[ComponentKind, int],
        shm_dir: Path = SHM_DIR,
        lock: InstanceLock | None = None,
        tp_size: int = 1,
    ) -> None:
        MemberTable.__init__(self, members, pages, "l1")
        self._instance = instance
        self._lock = lock
        self._tp_size = tp_size
        self._segments: dict[str, _Segment] = {}
        self._arrays: dict[str, np.ndarray] = {}
        sizes = [spec.layers * self.num_pages(spec.component) * spec.bytes_per_page_per_layer
                 for spec in self.members]
        with contextlib.suppress(OSError):  # (the segments' own reservations decide)
            free = os.statvfs(shm_dir)
            room = free.f_bavail * free.f_frsize
            if sum(sizes) > room:
                raise ResourceExhausted(
                    f"l1: {shm_dir} has {room} bytes free, the pools need {sum(sizes)} "
                    f"({len(sizes)} members; enlarge that tmpfs or lower tiers.l1.tokens / "
                    "tiers.l1.size_gb)")
        try:
            for spec in self.members:
                n = self.num_pages(spec.component)
                size = spec.layers * n * spec.bytes_per_page_per_layer
                path = shm_dir / segment_name(instance, os.getpid(), spec.name)
                seg = _Segment(path, size, create=True)
                self._segments[spec.name] = seg
                self._arrays[spec.name] = np.frombuffer(seg.map, dtype=np.uint8).reshape(
                    spec.layers, n, spec.bytes_per_page_per_layer
                )
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(
        cls, cfg: HicacheConfig, instance: str, shm_dir: Path = SHM_DIR
    ) -> ShmDevicePools:
        """Lock `instance`, clean its stale segments, then create the pools sized by `cfg`
        (they hold the lock until closed)."""
        lock = InstanceLock(instance, shm_dir, wait_s=LOCK_WAIT_S)
        try:
            cleanup_stale_segments(instance, shm_dir, lock)
            swept = sweep_dead_instances(shm_dir, keep=instance)
            if swept:
                log.warning("removed %d shared-memory segments of dead daemons under other "
                            "instance names: %s", len(swept), ", ".join(swept))
            members = cfg.model.members
            pages = {m.component: cfg.pages_for(m.component) for m in members}
            return cls(instance, members, pages, shm_dir, lock, cfg.model.tp_size)
        except BaseException:
            lock.release()
            raise

    @property
    def is_cuda(self) -> bool:
        return False

    @property
    def instance(self) -> str:
        return self._instance

    def segment_paths(self) -> tuple[Path, ...]:
        return tuple(seg.path for seg in self._segments.values())

    def layer(self, member: str, layer: int) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.layer_array(member, layer))

    def layer_array(self, member: str, layer: int) -> npt.NDArray[np.uint8]:
        self.checked_layer(member, layer)
        self._require_open()
        return self._arrays[member][layer]

    def _require_open(self) -> None:
        if not self._segments:
            raise FailedPrecondition(f"L1 pools of instance {self._instance!r} are closed")

    def descriptors(self, tp_rank: int = 0) -> tuple[PoolDescriptor, ...]:
        """Rank `tp_rank`'s shard of each row starts `tp_rank` shards into it; the row's
        stride stays the whole row's."""
        self._require_open()
        if not 0 <= tp_rank < self._tp_size:
            raise InvalidArgument(f"tp_rank {tp_rank}: the pools hold {self._tp_size} ranks' shards")
        out = []
        for spec in self.members:
            n = self.num_pages(spec.component)
            out.append(
                PoolDescriptor(
                    member=spec.name,
                    kind=PoolKind.SHM,
                    handle=self._segments[spec.name].path.name.encode(),
                    device=-1,
                    num_pages=n,
                    layer_stride_bytes=n * spec.bytes_per_page_per_layer,
                    page_stride_bytes=spec.bytes_per_page_per_layer,
                    layers=spec.layers,
                    offset_bytes=tp_rank * (spec.bytes_per_page_per_layer // self._tp_size),
                    size_bytes=spec.layers * n * spec.bytes_per_page_per_layer,
                )
            )
        return tuple(out)

    def close(self) -> None:
        self._arrays.clear()
        for seg in self._segments.values():
            seg.close(unlink=True)
        self._segments.clear()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def build_device_pools(
    cfg: HicacheConfig, instance: str, use_cuda: bool | None = None, shm_dir: Path = SHM_DIR
) -> DevicePools:
    """The L1 pools of this node: CUDA when available (or `use_cuda`), shared memory else.

    Raises `FailedPrecondition` if `use_cuda` is True without CUDA or if another live
    daemon serves `instance`.
    """
    if use_cuda is None:
        wanted = cfg.tiers.l1.device
        if wanted is L1Device.CUDA and not cuda_available():
            # (a GPU node whose driver or device nodes the service cannot reach would
            # otherwise serve a shared-memory L1 that no engine's GPU kernels can use)
            raise FailedPrecondition("tiers.l1.device=cuda: CUDA is not available to this "
                                     "process (driver, device nodes, CUDA_VISIBLE_DEVICES?)")
        use_cuda = wanted is L1Device.CUDA or (wanted is L1Device.AUTO and cuda_available())
    if use_cuda:
        from hicache.tiers.cuda import CudaDevicePools

        return CudaDevicePools.create(cfg)
    return ShmDevicePools.create(cfg, instance, shm_dir)


def attach_device_pools(
    descriptors: Sequence[PoolDescriptor],
    members: Sequence[MemberSpec] = (),
    shm_dir: Path = SHM_DIR,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Engine side: map every pool; member -> per-layer uint8 tensors ``[num_pages, page]``,
    a page being the member's `bytes_per_page_per_layer` (from `members`, the attach's
    geometry: a tensor-parallel rank's shard of a wider row) or else the page stride.

    SHM pools come back as CPU tensors over the shared mapping (the mapping lives as long
    as any of them); CUDA IPC pools as CUDA tensors over the opened IPC allocation.
    Raises `NotFound` for a segment that no longer exists and `InvalidArgument` for a
    descriptor that does not fit its segment.
    """
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    specs = {m.name: m for m in members}
    if len(specs) < len(members):
        raise InvalidArgument("the attach lists a member twice")
    for desc in descriptors:
        _check_descriptor(desc, specs, out)
        if desc.kind is PoolKind.CUDA_IPC:
            from hicache.tiers.cuda import open_ipc_pool

            out[desc.member] = open_ipc_pool(desc)
            continue
        name = _segment_name(desc)
        spec = specs.get(desc.member)
        width = spec.bytes_per_page_per_layer if spec is not None else desc.page_stride_bytes
        if not 0 < width <= desc.page_stride_bytes:
            raise InvalidArgument(f"{desc.member}: a page of {width} bytes in a stride of "
                                  f"{desc.page_stride_bytes}")
        # (the last byte the views reach: the last layer's last page's end)
        end = (desc.offset_bytes + (desc.layers - 1) * desc.layer_stride_bytes
               + (desc.num_pages - 1) * desc.page_stride_bytes + width)
        seg = _Segment(shm_dir / name, end, create=False)
        import torch  # (the engine's side: its KV is torch tensors)

        flat = torch.from_numpy(np.frombuffer(seg.map, dtype=np.uint8))
        out[desc.member] = tuple(
            flat.as_strided((desc.num_pages, width), (desc.page_stride_bytes, 1), start)
            for start in (
                desc.offset_bytes + layer * desc.layer_stride_bytes for layer in range(desc.layers)
            )
        )
    return out


def _check_descriptor(desc: PoolDescriptor, specs: Mapping[str, MemberSpec],
                      mapped: Mapping[str, object]) -> None:
    """A descriptor the engine can map without reaching another layer's or another pool's
    bytes (the daemon's reply is the last word on where the engine writes KV): one pool
    per member, of the member's layer count, layers apart, pages apart. Raises
    `InvalidArgument` naming the member."""
    member = desc.member
    if member in mapped:
        raise InvalidArgument(f"{member}: the attach describes its pool twice")
    if specs and member not in specs:
        raise InvalidArgument(f"{member}: a pool for a member the attach does not list")
    spec = specs.get(member)
    if desc.layers < 1 or desc.num_pages < 1:
        raise InvalidArgument(f"{member}: a pool of {desc.layers} layers and {desc.num_pages} "
                              "pages (at least one of each)")
    if spec is not None and desc.layers != spec.layers:
        raise InvalidArgument(f"{member}: a pool of {desc.layers} layers for a member of "
                              f"{spec.layers}")
    if desc.page_stride_bytes < 1 or desc.offset_bytes < 0:
        raise InvalidArgument(f"{member}: page stride {desc.page_stride_bytes}, offset "
                              f"{desc.offset_bytes}")
    if desc.layers > 1 and desc.layer_stride_bytes < desc.num_pages * desc.page_stride_bytes:
        raise InvalidArgument(
            f"{member}: layers {desc.layer_stride_bytes} bytes apart overlap (each holds "
            f"{desc.num_pages} pages of {desc.page_stride_bytes} bytes)")


def _segment_name(desc: PoolDescriptor) -> str:
    """The shm segment a descriptor names: a hicache segment's name, never a path."""
    try:
        name = desc.handle.decode("ascii")
    except UnicodeDecodeError:
        name = ""
    if ("/" in name or "\0" in name or not name.startswith(SEGMENT_PREFIX)
            or not name.isprintable()):
        raise InvalidArgument(f"{desc.member}: {desc.handle[:64]!r} is not a hicache shm "
                              "segment name")
    return name
