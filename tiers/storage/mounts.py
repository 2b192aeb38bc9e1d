"""Which filesystem holds a path, and is it one that other nodes can see?"""

from __future__ import annotations

import os

# Filesystem types that are shared between machines (network or cluster filesystems).
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "ceph",
        "glusterfs",
        "gpfs",
        "beegfs",
        "orangefs",
        "9p",
        "afs",
        "ocfs2",
        "gfs2",
        "juicefs",
        "weka",
        "wekafs",
    }
)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, fs type) for each line of a /proc/<pid>/mountinfo text."""
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount_point = fields[4].encode().decode("unicode_escape")  # \040 etc.
        out.append((mount_point, right.split()[0]))
    return out


def fs_type_of(path: str, mountinfo_text: str | None = None) -> str:
    """Filesystem type of the mount holding `path` (the longest matching mount point);
    "unknown" when /proc is not readable."""
    if mountinfo_text is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo_text = f.read()
        except OSError:
            return "unknown"
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    for mount_point, kind in parse_mountinfo(mountinfo_text):
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, kind
    return fstype


def is_shared_fs(fstype: str) -> bool:
    """True for network/cluster filesystems (and FUSE mounts, which usually are)."""
    return fstype in SHARED_FS_TYPES or fstype == "fuse" or fstype.startswith("fuse.")
