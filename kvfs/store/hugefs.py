"""A tmpfs of the daemon's own, mounted with ``huge=within_size``, for the RAM tier.

Every new RAM-tier object is written into freshly allocated tmpfs pages (a commit's copy out of
the caller's memfd, a write through the mount); on a tmpfs mounted with huge pages the kernel
allocates large folios on that path and the copy runs ~2x faster (docs/operations.md, "A RAM
tier on huge pages"). ``/dev/shm`` is mounted ``huge=never`` on most systems, so a daemon that
may mount (root) makes its own inside ``shm_dir``: a fresh directory ``kvfs-<instance>.hugefs-<random>``
(created by us, mode 0700, so nothing planted in advance can be it) with the tmpfs mounted on
it through its descriptor (a rename or symlink swap cannot redirect the mount), mode 0755,
``nosuid,nodev``, sized to the RAM budget plus room for write buffers and the name table.
Unmounted (lazily: leased files stay readable to their holders) when the tier closes; what a
killed daemon left is unmounted by the next start of the same instance.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import stat
from pathlib import Path

from kvfs.store import names, safedir

log = logging.getLogger(__name__)

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
_libc: ctypes.CDLL | None = None


def _call(fn: str, *args) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, fn)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def tag(instance_id: str) -> str:
    return f"kvfs-{instance_id}.hugefs-"


def size_for(capacity: int) -> int:
    """The tmpfs's size limit: the budget, a quarter more for write buffers past it (they spill
    to NVMe only once RAM is over its budget), and 256 MiB for the name table and small files."""
    return capacity + capacity // 4 + (256 << 20)


def sweep(parent: Path, instance_id: str, tier_prefix: str) -> int:
    """Unmount and remove what a dead daemon of this instance mounted in ``parent``: only real
    directories owned by us whose lock no live daemon holds (a copied state directory starts
    a second daemon of the same instance); their tier directories' name tables are retired
    first (readers stop answering from them). Returns how many went."""
    n = 0
    try:
        entries = [e for e in os.listdir(parent) if e.startswith(tag(instance_id))]
    except OSError:
        return 0
    for name in entries:
        path = Path(parent) / name
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue                    # not ours (a sticky parent: nobody else can swap it)
            fd = os.open(path, safedir.DIR_FLAGS)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue                    # a live daemon's
            finally:
                os.close(fd)
            if os.path.ismount(path):
                safedir.remove_stale_dirs(path, tier_prefix, before=names.retire)
                _call("umount2", str(path).encode(), MNT_DETACH)
            os.rmdir(path)
            n += 1
        except OSError as e:
            log.warning("could not remove the stale RAM tmpfs %s: %s", path, e)
    return n


def mount(parent: Path, instance_id: str, capacity: int) -> tuple[Path, int]:
    """A fresh huge-page tmpfs in ``parent`` and a descriptor of its root holding its lock
    (keep it while the tier lives); OSError when this process may not mount (not root) or the
    kernel refuses the options."""
    path, fd = safedir.make_unique_dir(parent, tag(instance_id))
    try:
        opts = f"size={size_for(capacity)},huge=within_size,mode=0755"
        _call("mount", b"kvfs-ram", f"/proc/self/fd/{fd}".encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
              opts.encode())
    except OSError:
        os.close(fd)
        os.rmdir(path)
        raise
    os.close(fd)
    root = os.open(path, safedir.DIR_FLAGS)
    fcntl.flock(root, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, root


def detach(path: str) -> None:
    """Unmount (lazily) a tmpfs of ours that no daemon holds any more (``kvfs umount`` of a
    dead daemon's mount when :func:`sweep` could not clear it)."""
    _call("umount2", str(path).encode(), MNT_DETACH)


def unmount(path: Path, root: int) -> None:
    os.close(root)
    _call("umount2", str(path).encode(), MNT_DETACH)
    os.rmdir(path)
