"""mount(2) of a ``/dev/fuse`` descriptor and the lazy unmount, for kvfs's own transport
(kvfs/fs/session.py) and the supervisor that holds a mount's session (kvfs/supervisor.py):
ctypes and the standard library only, so the supervisor loads no store code."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import stat

log = logging.getLogger(__name__)

MS_NOSUID, MS_NODEV = 0x2, 0x4
MNT_DETACH = 2
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount_device(mountpoint: str, options: set[str]) -> int:
    """Open ``/dev/fuse`` and mount it at ``mountpoint`` with ``options``; the descriptor
    (the kernel then sends INIT on it). Used by the daemon, and by the supervisor that holds
    the descriptor for the mount's life (kvfs/supervisor.py)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fsname = next((o.split("=", 1)[1] for o in options if o.startswith("fsname=")), "kvfs")
    subtype = next((o.split("=", 1)[1] for o in options if o.startswith("subtype=")), None)
    passed = sorted(o for o in options if o in ("allow_other", "default_permissions"))
    mode = stat.S_IFMT(os.stat(mountpoint).st_mode)
    data = ",".join([f"fd={fd}", f"rootmode={mode:o}", f"user_id={os.getuid()}",
                     f"group_id={os.getgid()}", *passed])
    fstype = f"fuse.{subtype}" if subtype else "fuse"
    if _LIBC.mount(fsname.encode(), mountpoint.encode(), fstype.encode(),
                   MS_NOSUID | MS_NODEV, data.encode()) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")
    return fd


def detach(mountpoint: str) -> None:
    """Unmount lazily (MNT_DETACH), as libfuse does for root; not mounted is no error."""
    if _LIBC.umount2(mountpoint.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            log.warning("umount %s: %s", mountpoint, os.strerror(err))
