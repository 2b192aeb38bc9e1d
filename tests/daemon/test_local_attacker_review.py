"""Review: a local attacker on the daemon's node, and the daemon's file-system safety.

Another local user (another pod sharing the node's /tmp or /dev/shm, a tenant's shell) may
pre-create, replace or read what the daemon creates: the unix socket and its lock file,
the folder it creates for them, the L1 shared-memory segments and their instance lock,
and the file L3's folders, objects and temp files. These tests run real `hicache serve`
processes (as root here, as the daemon often runs in a container) under the umasks an
operator may leave (000, 022), with symlinks and foreign files planted where the daemon
writes, and check the modes and the contents of everything afterwards.

Tests marked xfail(strict) pin bugs found in this review.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.config import load_config
from hicache.endpoint import parse_address

from .daemonkit import PAGE, Daemon, eventually, tokens

OTHER_UID = 4242  # "another local user" (owns the files an attacker plants)
FILE_L3 = ("storage.backend=file", "write.l1_to_l2=write_through",
           "write.l2_to_l3=write_through", "storage.required=true")


# ------------------------------------------------------------------------- helpers


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _started_under_umask(d: Daemon, umask: int, wait: bool = True) -> Daemon:
    """`d` started as a child that inherits `umask` (an operator's shell, a container's
    entrypoint); this process's umask is restored at once."""
    old = os.umask(umask)
    try:
        d.start(wait=False)
    finally:
        os.umask(old)
    if wait:
        d.wait_ready()
    return d


def _ready_or_exited(d: Daemon, timeout_s: float = 30.0) -> bool:
    """True once `d` serves, False once it exited (refused to start)."""
    assert d.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            return False
        if d.socket.exists():
            try:
                d.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
                return True
            except AssertionError:
                return False
        time.sleep(0.05)
    raise AssertionError(f"daemon neither served nor exited in {timeout_s} s:\n{d.log()}")


def _store(d: Daemon, pages: int, start: int, namespace: str = "") -> None:
    """An engine's request of `pages` pages, inserted and flushed down to L3."""
    prompt = tokens(pages * PAGE, start=start)
    with d.client(engine_id=f"e{start}") as c:
        c.attach()
        m = c.match(prompt, namespace, lock=True, allocate_tokens=len(prompt) // 4)
        c.insert(prompt, namespace, lock_id=m.lock_id, allocation_id=m.allocation_id)
        c.flush(timeout_s=10)


def _tree(root: Path) -> list[Path]:
    return [root, *sorted(root.rglob("*"))]


def _shm_files_of(d: Daemon) -> list[Path]:
    assert d.proc is not None
    instance = parse_address(d.listen).instance_name()
    return sorted(Path("/dev/shm").glob(f"hicache-{instance}*"))


class _ConfiguredDaemon(Daemon):
    """A `Daemon` that also reads a config file (`serve --config FILE`)."""

    def __init__(self, workdir: Path, config: Path, *sets: str) -> None:
        super().__init__(workdir, *sets)
        self.config = config

    def argv(self) -> list[str]:
        return [*super().argv(), "--config", str(self.config)]


# ------------------------------------------------ one daemon started under umask 000


@pytest.fixture(scope="module")
def loose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """A daemon started under umask 000 (a container entrypoint, a careless service
    manager), its socket in a folder it creates itself, its file L3 in a folder it creates
    itself; 4 pages stored in L3."""
    work = tmp_path_factory.mktemp("loose")
    root = work / "l3"
    listen = f"unix://{work}/run/hc/d.sock"
    d = Daemon(work, *FILE_L3, f"storage.file.path={root}", listen=listen)
    d.socket = work / "run" / "hc" / "d.sock"
    _started_under_umask(d, 0o000)
    _store(d, 4, start=1)
    yield d, root
    d.close()


def test_socket_and_shared_memory_keep_their_modes_under_umask_000(
        loose: tuple[Daemon, Path]) -> None:
    """The control socket is 0660 (spec), the L1 segments 0660 (the engine's group) and
    the instance lock private, whatever umask the daemon inherited."""
    d, _ = loose
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    assert _mode(d.socket) == 0o660
    lock = d.socket.with_name(d.socket.name + ".lock")
    assert _mode(lock) & 0o022 == 0, oct(_mode(lock))  # (holds only the pid)
    shm = _shm_files_of(d)
    assert any(p.name.endswith(".lock") for p in shm) and len(shm) >= 2, shm
    for p in shm:
        want = 0o600 if p.name.endswith(".lock") else 0o660
        assert _mode(p) == want, (p, oct(_mode(p)))


def test_the_socket_folder_the_daemon_creates_is_not_world_writable(
        loose: tuple[Daemon, Path]) -> None:
    """`SocketLock.acquire` creates a missing socket folder with `mkdir(parents=True)`:
    mode 0777 & ~umask. Under umask 000 anyone may then unlink the daemon's socket and
    bind their own at its path: engines connect to the impostor, which hands them
    descriptors of its own shared memory (the engine's KV, the cache's answers)."""
    d, _ = loose
    for folder in (d.socket.parent, d.socket.parent.parent):
        assert _mode(folder) & 0o002 == 0, (folder, oct(_mode(folder)))


def test_file_l3_under_umask_000_is_not_writable_by_other_users(
        loose: tuple[Daemon, Path]) -> None:
    """The objects carry a checksum, not a MAC: anyone who can write an object's file can
    replace it with KV of their choosing, which every tenant's engine then loads."""
    _, root = loose
    objects = [p for p in _tree(root) if p.suffix == ".kv"]
    assert objects, "nothing was stored"
    loose_modes = {str(p): oct(_mode(p)) for p in _tree(root) if _mode(p) & 0o002}
    assert not loose_modes, loose_modes


def test_namespaces_never_reach_paths_outside_the_file_l3(loose: tuple[Daemon, Path]) -> None:
    """A namespace that reads like a path only changes the key's digest: every file the
    daemon writes stays under the store's root, named by a digest."""
    d, root = loose
    before = set(root.parent.rglob("*"))
    _store(d, 2, start=10_000, namespace="../../../../etc/hicache-evil")
    _store(d, 2, start=20_000, namespace="/" + "x/" * 40)
    outside = [p for p in set(root.parent.rglob("*")) - before
               if root not in p.parents and not p.name.startswith("daemon-")]
    assert not outside, outside
    assert not Path("/etc/hicache-evil").exists()
    for p in root.rglob("*.kv"):
        assert len(p.stem) == 32 and p.parent.parent.parent == root, p


# ------------------------------------------------------------ umask 022 (the usual)


def test_file_l3_objects_are_not_readable_by_other_users_under_umask_022(tmp_path: Path) -> None:
    """The KV of a prompt reveals the prompt. In L1 it is group-only (0660, like the
    socket); the very same pages in the file L3 (`FileBackend._write_file` opens them
    0o644, `os.makedirs` takes the umask's 0755) are world-readable under the default
    umask, in /tmp/hicache by default."""
    root = tmp_path / "l3"
    d = Daemon(tmp_path, *FILE_L3, f"storage.file.path={root}")
    try:
        _started_under_umask(d, 0o022)
        _store(d, 3, start=1)
        objects = [p for p in _tree(root) if p.suffix == ".kv"]
        assert objects, "nothing was stored"
        readable = {str(p): oct(_mode(p)) for p in _tree(root) if _mode(p) & 0o007}
        assert not readable, readable
    finally:
        d.close()


# ------------------------------------------------------------ planted files and links


def test_a_symlink_at_the_socket_lock_path_never_clobbers_its_target(tmp_path: Path) -> None:
    """With the default `unix:///tmp/hicache.sock` the lock is /tmp/hicache.sock.lock, a
    name any local user can create first: as a symlink to a file the daemon's user may
    write (as root: any file; /etc/shadow), that file is truncated to the daemon's pid at
    start and emptied at stop (`os.open(..., O_RDWR | O_CREAT)` without O_NOFOLLOW, then
    `ftruncate` + `pwrite`)."""
    victim = tmp_path / "precious.conf"
    victim.write_text("root:precious:contents\n")
    d = Daemon(tmp_path)
    (tmp_path / "d.sock.lock").symlink_to(victim)
    try:
        d.start(wait=False)
        _ready_or_exited(d)
        assert victim.read_text() == "root:precious:contents\n"
    finally:
        d.close()
    assert victim.read_text() == "root:precious:contents\n"


def test_a_symlink_at_the_socket_path_is_refused_and_its_target_left_alone(
        tmp_path: Path) -> None:
    """A link planted at the socket's own path is neither followed (no bind through it, no
    chmod of its target) nor removed: the daemon refuses to start, naming the path."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.chmod(victim, 0o600)
    d = Daemon(tmp_path)
    d.socket.symlink_to(victim)
    try:
        d.start(wait=False)
        assert d.proc is not None
        assert d.proc.wait(timeout=30) != 0
    finally:
        d.close()
    assert "not a socket" in d.log() and str(d.socket) in d.log()
    assert d.socket.is_symlink()
    assert victim.read_text() == "keep me\n" and _mode(victim) == 0o600


def test_the_start_walk_removes_only_temp_files_the_daemon_names(tmp_path: Path) -> None:
    """`FileBackend._rebuild_index` removes any file whose name ends in '.tmp' once it is
    older than STALE_TEMP_S, in every folder under the root, whatever its name: a store
    path set to a shared folder (/tmp, /var/tmp, a home on NFS), or one reached through a
    link another user planted at /tmp/hicache, has the daemon (root) delete other users'
    files. Its own temp files are `<32 hex>.kv.<host>.<pid>.<thread>.tmp` in a fan-out
    folder: only those are its to remove."""
    root = tmp_path / "shared"
    (root / "alice").mkdir(parents=True)
    theirs = [root / "editor-swap.tmp", root / "alice" / "thesis.tmp"]
    hour_ago = time.time() - 3600
    for p in theirs:
        p.write_text("someone's work\n")
        os.utime(p, (hour_ago, hour_ago))
    # One of the daemon's own, from a writer on another host long gone: still removed.
    ours = root / "ab" / "cd" / ("abcd" + "0" * 28 + ".kv.otherhost.123.456.tmp")
    ours.parent.mkdir(parents=True)
    ours.write_bytes(b"torn")
    os.utime(ours, (hour_ago, hour_ago))
    # With a capacity, the start waits for the walk: it is done once the daemon serves.
    d = Daemon(tmp_path, *FILE_L3, f"storage.file.path={root}", "storage.file.capacity_gb=1")
    try:
        d.start()
        assert eventually(lambda: not ours.exists(), timeout_s=10)
        assert [p for p in theirs if not p.exists()] == []
    finally:
        d.close()


def test_a_world_writable_file_l3_root_of_another_user_is_not_used_silently(
        tmp_path: Path) -> None:
    """The default store is /tmp/hicache, a name any local user can take first: a folder
    of theirs, mode 0777. The daemon writes every tenant's KV into it (readable, and
    replaceable at will by its owner or anyone else) without a word. It should refuse
    such a root (as sshd refuses a loose ~/.ssh), or at least say so in its log."""
    root = tmp_path / "hicache"
    root.mkdir()
    os.chown(root, OTHER_UID, OTHER_UID)
    os.chmod(root, 0o777)
    d = Daemon(tmp_path, *FILE_L3, f"storage.file.path={root}")
    try:
        d.start(wait=False)
        served = _ready_or_exited(d)
        if served:
            _store(d, 2, start=1)
    finally:
        d.close()
    log = d.log()
    refused = not served and str(root) in log
    warned = any(str(root) in line and "WARNING" in line  # (the test's folder names "writable")
                 and "writable" in line.replace(str(root), "") for line in log.splitlines())
    assert refused or warned, log[-3000:]


def test_a_planted_shm_segment_is_never_reused(tmp_path: Path) -> None:
    """Another user's file at the very name of a segment the daemon is about to create
    (its instance, its pid, a member), holding their bytes: the daemon removes it (it is a
    dead instance's, as far as the name says) and creates its own (O_EXCL), 0660, with
    its own bytes; the planted bytes never reach an engine. (A private shm folder stands
    for /dev/shm.)"""
    from hicache.tiers.device import ShmDevicePools, segment_name

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    os.chmod(shm, 0o1777)
    cfg = load_config(None, ["tiers.l1.tokens=1024", "tiers.l2.reserve_gb=0"])
    instance = "planted_test"
    planted = shm / segment_name(instance, os.getpid(), "full")
    size = 4 * 16 * cfg.model.page_size * 256
    planted.write_bytes(b"\xee" * size)
    os.chown(planted, OTHER_UID, OTHER_UID)
    os.chmod(planted, 0o666)
    planted_ino = os.stat(planted).st_ino
    pools = ShmDevicePools.create(cfg, instance, shm)
    try:
        (path,) = [p for p in pools.segment_paths() if p.name == planted.name]
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_ino != planted_ino or st.st_uid != OTHER_UID
        assert not pools.layer("full", 0).numpy().any()  # a fresh segment: zeros
    finally:
        pools.close()
    assert not any(shm.iterdir())  # (nothing left behind, the lock included)


def test_a_world_readable_config_holding_tokens_is_warned_about(tmp_path: Path) -> None:
    """The tokens live in the config file (`serve` has no other way in but `--set`, which
    /proc/<pid>/cmdline shows to every local user). Installed by hand (`cp`, umask 022)
    the file is 0644: every local user can read every tenant's token. The daemon reads
    the file and knows its mode; like sshd with a loose key, it should say so (or refuse)."""
    secret = "local-attacker-review-token-0123456789"
    config = tmp_path / "hicache.yaml"
    config.write_text(f"server:\n  tokens:\n    - {{token: {secret}, namespaces: ['*']}}\n")
    os.chmod(config, 0o644)
    d = _ConfiguredDaemon(tmp_path, config)
    try:
        served = _ready_or_exited(d.start(wait=False))
    finally:
        d.close()
    log = d.log()
    assert secret not in log
    warned = any("WARNING" in line and str(config) in line  # (the test's folder names "readable")
                 and "readable" in line.replace(str(config), "") for line in log.splitlines())
    assert warned or (not served and str(config) in log), log[-3000:]
